"""The engine fit of the step-time model (whale.planner.calibration_cache.EngineTiming, whale.calibration.engine)
and the split-module collectives (whale.planner.steptime.cost.split_module_comm_time). No processes."""

from __future__ import annotations

import math
import statistics

import pytest

from whale.planner.calibration_cache import ENGINE_VERSION, MODEL_ENGINE_VERSION, Calibration, EngineTiming
from whale.planner.steptime import cost
from whale.planner.steptime.simulate import StageCost, segment_seconds


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


def test_crowded_ranks_pay_the_crowding_on_the_whole_engine_segment():
    """4 ranks on 2 cores with crowd 0.25: every engine second x 1.25; 6 ranks x 1.5; up to one rank per core,
    without a crowding fit, or off this machine (ranks 0): unchanged."""
    e = EngineTiming(fwd_scale=2.0, bwd_scale=3.0, fwd_overhead=0.1, split_fwd=0.5, crowd=0.25, crowd_cores=2)
    plain = e.segment(1.0, 2.0, 8.0, split_calls=1)
    assert e.crowding(0) == e.crowding(2) == 1.0 and e.crowding(4) == 1.25 and e.crowding(6) == 1.5
    assert e.segment(1.0, 2.0, 8.0, 1, ranks=4) == pytest.approx(tuple(1.25 * t for t in plain))
    assert EngineTiming(crowd=0.25).crowding(8) == 1.0
    st = StageCost(fwd_per_row=0.01, bwd_per_row=0.02)
    cal = Calibration(segment_overhead=0.0, engine=e)
    assert segment_seconds(st, 10, 8.0, cal, ranks=4) == pytest.approx(
        tuple(1.25 * t for t in segment_seconds(st, 10, 8.0, cal, ranks=2)))


def test_crowding_is_fitted_from_the_crowded_runs_against_the_two_rank_line(monkeypatch):
    """The crowded runs' engine seconds per emulated second over the 2-rank fit's, less one, per extra rank per
    core: runs 1.5x the fit on 4 ranks of a 2-core machine give crowd 0.5; a machine of 4 cores runs none."""
    from whale.calibration import engine as ce

    fit = EngineTiming(fwd_scale=2.0, bwd_scale=2.0, version=MODEL_ENGINE_VERSION)
    runs = [{"slowdown": 7.0, "wall_f": 1.5 * 2.0 * 0.1, "wall_b": 1.5 * 2.0 * 0.2}]
    monkeypatch.setattr(ce, "_spawn", lambda world, r, **kw: [runs] * world)
    monkeypatch.setattr(ce, "_isolated", lambda r, *a: (0.1, 0.2, 0))
    monkeypatch.setattr(ce.os, "cpu_count", lambda: 2)
    got = ce._crowding(fit, None, Calibration(), 1, 1, False)
    assert got.crowd == pytest.approx(0.5) and got.crowd_cores == 2 and got.crowding(4) == pytest.approx(1.5)
    monkeypatch.setattr(ce.os, "cpu_count", lambda: 4)
    assert ce._crowding(fit, None, Calibration(), 1, 1, False) is fit


def test_calibration_round_trips_the_engine_fits_and_picks_the_models_own():
    mine = EngineTiming(fwd_scale=1.7, version=MODEL_ENGINE_VERSION)
    cal = Calibration(key="k", engine=EngineTiming(fwd_scale=1.2), model_engines={"sig": mine})
    back = Calibration.from_dict(cal.to_dict())
    assert back == cal and back.for_model("sig").engine == mine and back.for_model("other") is back
    stale = Calibration(model_engines={"sig": EngineTiming(version=ENGINE_VERSION)})  # a machine-fit version
    assert stale.for_model("sig") is stale


def test_split_module_comm_time_counts_two_collectives_per_direction():
    bw, lat = 1e9, 1e-4
    assert cost.split_module_comm_time(16, 8, 100.0, 200.0, 1, bw, lat) == (0.0, 0.0)
    f, b = cost.split_module_comm_time(16, 8, 100.0, 200.0, 2, bw, lat)
    assert math.isclose(f, cost.ring_allgather_time(2 * 8 * 100.0, 2, bw, lat)
                        + cost.ring_allreduce_time(16 * 200.0, 2, bw, lat))
    assert math.isclose(b, cost.ring_allgather_time(2 * 8 * 200.0, 2, bw, lat)
                        + cost.ring_allreduce_time(16 * 100.0, 2, bw, lat))


def test_relative_line_recovers_an_exact_line_and_weights_small_segments():
    from whale.calibration.engine import _relative_line

    xs = [0.5, 1.0, 2.0, 8.0, 25.0]
    assert _relative_line(xs, [1.0 + 1.2 * x for x in xs]) == pytest.approx((1.0, 1.2))
    # one large segment 20% slow moves the intercept far less than least squares on absolute seconds would
    ys = [1.0 + 1.2 * x for x in xs]
    ys[-1] *= 1.2
    overhead, scale = _relative_line(xs, ys)
    assert abs(overhead - 1.0) < 0.25 and 1.2 < scale < 1.45
    flat = (1 / 3 + 1 / 2) / (1 / 9 + 1 / 4)  # the weighted mean of y
    assert _relative_line([1.0, 2.0], [3.0, 2.0]) == pytest.approx((flat, 0.0))  # falling: a flat line
    assert _relative_line([1.0, 2.0], [1.0, 4.0])[0] == 0.0  # negative intercept: through 0
    with pytest.raises(ValueError, match="y > 0"):
        _relative_line([1.0, 2.0], [0.0, 1.0])


def test_fit_segments_fits_lines_or_scales_with_given_intercepts():
    from whale.calibration.engine import _fit_segments

    ks = (0.5, 1.0, 2.0, 4.0)
    runs = [{"slowdown": s, "cpu_f": 0.2 + 1.0 * k, "cpu_b": 2.0 * k, "wall_f": 1.0 + 1.5 * k, "wall_b": 3.3 * k}
            for s in (0.0, 7.0) for k in ks]
    iso = [(k, 2.0 * k) for _ in (0, 1) for k in ks]
    fits = _fit_segments(runs, iso)
    assert fits == pytest.approx({"hot_fwd_scale": 1.0, "hot_fwd_overhead": 0.2, "hot_bwd_scale": 1.0,
                                  "hot_bwd_overhead": 0.0, "fwd_scale": 1.5, "fwd_overhead": 1.0,
                                  "bwd_scale": 1.65, "bwd_overhead": 0.0}, abs=1e-9)
    # a model's own runs: only the scales, the machine's intercepts kept (median of (engine - overhead) / X)
    fixed = {"hot_fwd_overhead": 0.2, "hot_bwd_overhead": 0.0, "fwd_overhead": 0.5, "bwd_overhead": 0.0}
    mine = _fit_segments(runs, iso, fixed)
    assert mine["fwd_overhead"] == 0.5 and mine["hot_fwd_scale"] == pytest.approx(1.0)
    assert mine["fwd_scale"] == pytest.approx(statistics.median((1.0 + 1.5 * k - 0.5) / k for k in ks))


def test_gpt_job_names_the_engine_fit_it_lacks(tmp_path, monkeypatch):
    from examples.gpt.model import for_plan
    from examples.gpt.predicted import _missing_fit
    from whale.frontend.unit_keys import unit_keys
    from whale.planner.calibration_cache import machine_key, model_signature, save

    model, (x, _), loss = for_plan(n_layer=2, n_embd=16, n_head=2, vocab_size=64, seq_len=8, batch=4)
    path = tmp_path / "cal.json"
    monkeypatch.setenv("WHALE_CALIBRATION", str(path))
    assert _missing_fit(model, x, tracked=True) == "engine calibration"  # nothing cached
    save(Calibration(key=machine_key(), engine=EngineTiming(version=ENGINE_VERSION - 1)), path)
    assert _missing_fit(model, x, tracked=True) == "engine calibration"  # an older procedure's fit
    save(Calibration(key=machine_key(), engine=EngineTiming()), path)
    assert _missing_fit(model, x, tracked=True) == "engine fit of this model"
    sig = model_signature(unit_keys(model, (x, x), None, loss, tracked=True))
    fit = EngineTiming(version=MODEL_ENGINE_VERSION)
    save(Calibration(key=machine_key(), engine=EngineTiming(), model_engines={sig: fit}), path)
    assert _missing_fit(model, x, tracked=True) == ""
    assert _missing_fit(model, x, tracked=False) == "engine fit of this model"  # untracked units: another key
