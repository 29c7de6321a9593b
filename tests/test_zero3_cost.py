"""ZeRO-3's costs inside compute segments (process-free): the collective calls per segment, their CPU seconds
in :func:`whale.planner.steptime.simulate.segment_seconds` (stretched with the rest of the segment) and the
gathers' transfer, which an emulated segment absorbs into its stretch."""

from __future__ import annotations

import pytest

from whale.cluster import ClusterSpec
from whale.plan.plan import Plan, TaskGraph
from whale.planner.calibration_cache import Calibration, EngineTiming
from whale.planner.steptime import cost
from whale.planner.steptime.simulate import StageCost, predict, segment_seconds


def test_zero3_calls_one_gather_when_even_one_broadcast_per_lane_otherwise():
    assert cost.zero3_collective_calls(4, 1, True) == (0, 0)  # one lane: nothing to gather
    assert cost.zero3_collective_calls(4, 2, True) == (4, 8)  # all-gather; all-gather + reduce-scatter
    assert cost.zero3_collective_calls(4, 4, False) == (16, 20)  # 4 broadcasts per gather
    assert cost.zero3_collective_calls(0, 4, False) == (0, 0)
    with pytest.raises(ValueError, match="units >= 0 and lanes >= 1"):
        cost.zero3_collective_calls(-1, 2, True)


@pytest.mark.parametrize("engine", [None, EngineTiming(fwd_scale=1.5, bwd_scale=2.0, micro_batch_overhead=0.01)])
def test_collective_cpu_is_compute_the_factor_stretches(engine):
    st = StageCost(fwd_per_row=1e-3, bwd_per_row=2e-3)
    calib = Calibration(engine=engine, collective_cpu_seconds=1e-4)
    f0, b0 = segment_seconds(st, 4, 8.0, calib)
    f1, b1 = segment_seconds(st, 4, 8.0, calib, calls=(16, 20))
    assert f1 - f0 == pytest.approx(8.0 * 16 * 1e-4) and b1 - b0 == pytest.approx(8.0 * 20 * 1e-4)


def _dp2(zero: int) -> Plan:
    return Plan(world_size=2, task_graphs=(TaskGraph(0, "replicate", 2),), num_replicas=1, num_micro_batch=2,
                zero=zero)


CAL = Calibration(collective_cpu_seconds=1e-3, segment_overhead=0.0, step_overhead=0.0,
                  optimizer_seconds_per_element=0.0, allreduce_bandwidth=1e9, allreduce_latency=0.0)
ST = StageCost(fwd_per_row=1e-3, bwd_per_row=2e-3, trainable_elements=10**6, zero3_units=2)


def test_zero3_segments_pay_their_collectives_cpu_and_emulation_absorbs_the_gather():
    """Two even lanes, 2 units: per micro-batch of 4 rows 2 calls forward and 4 backward at 1 ms of CPU each;
    the gather of 4 MB at 1 GB/s over 2 lanes is 2 ms off the CPU. Emulated (factor 2: 2 ranks on 1 core) the
    segment is its stretched CPU, the gather hidden in the stretch; on the calibration machine it adds."""
    emulated = ClusterSpec.from_dict({"emulate": True, "nodes": [{"devices": ["V100-32GB", "V100-32GB"]}]})
    z3 = predict(_dp2(3), [ST], emulated, CAL, 16, cores=1.0)
    assert z3.stage_fwd[0] == pytest.approx(2 * (4e-3 + 2e-3))
    assert z3.stage_bwd[0] == pytest.approx(2 * (8e-3 + 4e-3))
    assert predict(_dp2(2), [ST], emulated, CAL, 16, cores=1.0).stage_fwd[0] == pytest.approx(2 * 4e-3)
    local = predict(_dp2(3), [ST], None, CAL, 16)
    assert local.stage_fwd[0] == pytest.approx(4e-3 + 2e-3 + 2e-3)
