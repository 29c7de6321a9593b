"""The engine fit of the step-time model (whale.plan.calibration.EngineTiming, whale.frontend.calibrate_engine)
and the split-module collectives (whale.plan.cost.split_module_comm_time). No processes."""

from __future__ import annotations

import math

import pytest

from whale.plan import cost
from whale.plan.calibration import ENGINE_VERSION, Calibration, EngineTiming
from whale.plan.simulate import StageCost, segment_seconds


def test_engine_timing_blends_hot_and_stretched_fits_by_waiting_fraction():
    e = EngineTiming(fwd_scale=2.0, bwd_scale=3.0, hot_fwd_scale=1.0, hot_bwd_scale=1.0, fwd_overhead=0.1,
                     split_fwd=0.5, split_bwd=0.25, stretch=8.0)
    assert e.weight(1.0) == 0.0 and e.weight(0.01) == 0.0 and e.weight(8.0) == 1.0 and e.weight(100.0) == 1.0
    assert math.isclose(e.weight(2.0), 0.5 / (7 / 8))
    assert e.segment(1.0, 1.0, 1.0) == (1.0, 1.0)  # hot: no waits
    f, b = e.segment(1.0, 2.0, 8.0, split_calls=2)
    assert math.isclose(f, 2.0 + 0.1 + 1.0) and math.isclose(b, 6.0 + 0.5)


def test_segment_seconds_stretches_the_engine_seconds_and_adds_the_micro_batch_overhead():
    st = StageCost(fwd_per_row=0.01, bwd_per_row=0.02, fwd_overhead=0.1, bwd_overhead=0.2)
    old = Calibration(segment_overhead=0.05)
    assert segment_seconds(st, 10, 2.0, old) == pytest.approx((2 * 0.25, 2 * 0.45))
    new = Calibration(segment_overhead=0.0, engine=EngineTiming(fwd_scale=1.5, bwd_scale=1.2,
                                                                micro_batch_overhead=0.02))
    assert segment_seconds(st, 10, 8.0, new) == pytest.approx((8 * 1.5 * 0.2 + 0.01, 8 * 1.2 * 0.4 + 0.01))


def test_calibration_round_trips_the_engine_fits_and_picks_the_models_own():
    mine = EngineTiming(fwd_scale=1.7)
    cal = Calibration(key="k", engine=EngineTiming(fwd_scale=1.2), model_engines={"sig": mine})
    back = Calibration.from_dict(cal.to_dict())
    assert back == cal and back.for_model("sig").engine == mine and back.for_model("other") is back
    stale = Calibration(model_engines={"sig": EngineTiming(version=ENGINE_VERSION - 1)})
    assert stale.for_model("sig") is stale


def test_split_module_comm_time_counts_two_collectives_per_direction():
    bw, lat = 1e9, 1e-4
    assert cost.split_module_comm_time(16, 8, 100.0, 200.0, 1, bw, lat) == (0.0, 0.0)
    f, b = cost.split_module_comm_time(16, 8, 100.0, 200.0, 2, bw, lat)
    assert math.isclose(f, cost.ring_allgather_time(2 * 8 * 100.0, 2, bw, lat)
                        + cost.ring_allreduce_time(16 * 200.0, 2, bw, lat))
    assert math.isclose(b, cost.ring_allgather_time(2 * 8 * 200.0, 2, bw, lat)
                        + cost.ring_allreduce_time(16 * 100.0, 2, bw, lat))


def test_fit_segments_takes_median_ratios():
    from whale.frontend.calibrate_engine import _fit_segments

    runs = [{"slowdown": s, "cpu_f": 1.0 * k, "cpu_b": 2.0 * k, "wall_f": 1.5 * k, "wall_b": 3.3 * k}
            for s in (0.0, 7.0) for k in (1.0, 2.0, 4.0)]
    iso = [(k, 2.0 * k) for _ in (0, 1) for k in (1.0, 2.0, 4.0)]
    fits = _fit_segments(runs, iso)
    assert fits == pytest.approx({"hot_fwd_scale": 1.0, "hot_bwd_scale": 1.0, "fwd_scale": 1.5,
                                  "bwd_scale": 1.65})
