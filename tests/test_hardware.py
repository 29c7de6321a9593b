"""Hardware-aware planning wired into the plan (no processes), and emulation arithmetic."""

from __future__ import annotations

import pytest
import torch

import whale as wh
from tests.models import TinyLM
from whale.cluster import ClusterSpec, emulation_cores
from whale.planner.balance import InfeasiblePlanError
from whale.planner.hardware import MemoryModel, apply_hardware
from whale.runtime.emulation import EmulatedDevice, emulation_slowdown


def _spec(*names, emulate=False, memory_scale=1.0, per_node=None):
    per_node = per_node or len(names)
    nodes = [{"devices": list(names[i:i + per_node])} for i in range(0, len(names), per_node)]
    return ClusterSpec.from_dict({"emulate": emulate, "memory_scale": memory_scale, "nodes": nodes})


def _batch(rows=32, seq=8):
    x = torch.randint(0, 32, (rows, seq))
    return x, x


def test_data_parallel_shares_follow_device_speed():
    spec = _spec("V100-32GB", "P100-16GB", "V100-32GB", "P100-16GB", emulate=True)
    plan = wh.plan_model(TinyLM(), 4, wh.Config(cluster=spec))
    w = plan.lane_weights
    assert w[0] / w[1] == pytest.approx(15.7 / 10.6)
    assert plan.devices == ("V100-32GB", "P100-16GB", "V100-32GB", "P100-16GB")
    assert plan.predicted_utilization == pytest.approx([1.0] * 4)
    text = str(plan)
    assert "EMULATED" in text and "V100-32GB" in text and "busy: predicted share" in text
    assert wh.Plan.from_json(plan.to_json()) == plan


def test_hardware_aware_off_keeps_equal_shares():
    spec = _spec("V100-32GB", "P100-16GB")
    plan = wh.plan_model(TinyLM(), 2, wh.Config(cluster=spec, hardware_aware=False))
    assert plan.lane_weights == (1.0, 1.0) and plan.devices == ()


def test_pipeline_orders_devices_by_memory_and_cuts_by_speed():
    spec = _spec("P100-16GB", "V100-32GB")  # rank 0 has less memory: it should not run stage 0
    model = TinyLM(stage_layers=(3, 3))
    uniform = wh.plan_model(model, 2, wh.Config(num_micro_batch=4, cluster=spec, hardware_aware=False))
    aware = wh.plan_model(model, 2, wh.Config(num_micro_batch=4, cluster=spec), sample_batch=_batch())
    assert uniform.coords(0) == (0, 0)
    assert aware.device_order == (1, 0) and aware.coords(1) == (0, 0)
    first = aware.stage_cuts[0].units
    assert sum(name.startswith("blocks.") for name in first) > 3  # the faster V100 takes more blocks
    assert aware.stage_flops[0] > aware.stage_flops[1]


def test_memory_model_moves_load_off_a_small_device():
    spec = _spec("V100-32GB", "P100-16GB")
    base = wh.plan_model(TinyLM(), 2, wh.Config())
    fast_only = MemoryModel(global_batch=100, fixed_bytes=[1e9], per_sample_bytes=[1e8])
    # FLOPS-proportional would give the P100 ~40 samples = 5 GB; it has 16 GB -> fits
    plan = apply_hardware(base, spec, fast_only)
    assert plan.lane_weights == (60.0, 40.0)
    tight = MemoryModel(global_batch=100, fixed_bytes=[1e9], per_sample_bytes=[4e8])
    plan = apply_hardware(base, spec, tight)  # P100 holds (16e9-1e9)/4e8 = 37 samples at most
    assert plan.lane_weights == (63.0, 37.0)


def test_infeasible_memory_names_rank_and_bytes():
    spec = _spec("V100-32GB", "P100-16GB")
    base = wh.plan_model(TinyLM(), 2, wh.Config())
    with pytest.raises(InfeasiblePlanError, match=r"rank 1 \(P100-16GB, stage 0\) needs .* it lacks"):
        apply_hardware(base, spec, MemoryModel(8, fixed_bytes=[17e9], per_sample_bytes=[1.0]))


def test_split_shard_weights_follow_speed():
    from tests.test_split_runtime import Classifier

    spec = _spec("V100-32GB", "T4")
    plan = wh.plan_model(Classifier(), 2, wh.Config(cluster=spec))
    head = next(tg for tg in plan.task_graphs if tg.kind == "split")
    assert head.shard_weights == pytest.approx([15.7e12, 8.1e12])
    assert "shard shares" in str(plan)


def test_cluster_must_match_world_size():
    with pytest.raises(wh.cluster.ClusterError, match="world size"):
        wh.plan_model(TinyLM(), 3, wh.Config(cluster=_spec("V100-32GB", "P100-16GB")))


def test_emulation_slowdown_keeps_device_ratios_and_cores_free():
    spec = _spec("V100-32GB", "P100-16GB", "V100-32GB", "P100-16GB", emulate=True)
    fast = emulation_slowdown(spec, 0, 4, cores=2)
    slow = emulation_slowdown(spec, 1, 4, cores=2)
    assert fast == pytest.approx(1.0)  # base = 4 ranks / 2 cores: each rank computes at most half the time
    assert (1 + slow) / (1 + fast) == pytest.approx(15.7 / 10.6)
    assert emulation_slowdown(spec, 0, 2, cores=2) == 0.0
    assert emulation_slowdown(_spec("V100-32GB", "P100-16GB"), 1, 2) == 0.0  # not emulating


def test_emulation_cores_reads_the_environment_and_names_bad_values(monkeypatch):
    monkeypatch.setenv("WHALE_EMULATION_CORES", "1.5")
    assert emulation_cores() == 1.5
    spec = _spec("V100-32GB", "V100-32GB", "V100-32GB", emulate=True)
    assert emulation_slowdown(spec, 0, 3) == pytest.approx(1.0)  # 3 ranks on 1.5 cores: base 2
    for bad in ("abc", "0", "-2", "1e-9", "inf", "nan"):
        monkeypatch.setenv("WHALE_EMULATION_CORES", bad)
        with pytest.raises(ValueError, match="WHALE_EMULATION_CORES"):
            emulation_cores()
    monkeypatch.delenv("WHALE_EMULATION_CORES")
    assert emulation_cores() >= 1 and emulation_cores(4) == 4.0


class _FakeClock:
    """Wall clock for EmulatedDevice: ``now`` seconds; sleeping advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _device(slowdown, clock, **kw):
    return EmulatedDevice(slowdown, clock=clock, cpu_clock=clock, sleep=clock.sleep, **kw)


def test_emulated_device_stretches_segments_by_their_typical_cost():
    clock = _FakeClock()
    dev = _device(2.0, clock, window=3)
    ends = []
    for cpu in (1.0, 1.3, 0.7, 1.0):  # each segment ran on the core for exactly its CPU time
        start = clock.now
        clock.now += cpu
        dev.wait("F", start, start, cpu)
        ends.append(clock.now - start)
    # emulated duration = (1 + 2) x median of this key's last 3 CPU times: the jitter is absorbed
    assert ends == pytest.approx([3 * 1.0, 3 * 1.15, 3 * 1.0, 3 * 1.0])
    start = clock.now  # a segment slower than 3x its median shows through (never ends before its compute)
    clock.now += 5.0
    dev.wait("F", start, start, 5.0)
    assert clock.now - start == pytest.approx(5.0)
    start = clock.now  # another key keeps its own history
    clock.now += 0.1
    assert dev.wait(("B", (4, 8)), start, start, 0.1) == pytest.approx(0.2)


def test_emulated_device_absorbs_time_spent_waiting_for_a_core():
    clock = _FakeClock()
    dev = _device(3.0, clock)
    clock.now = 1.5  # 0.5 s of CPU took 1.5 s of wall time (another rank held the core)
    assert dev.wait("F", 0.0, 0.0, 0.5) == pytest.approx(0.5)  # ends at 0.5 x (1 + 3) = 2.0 all the same
    clock.now = 10.0  # later than the emulated end: no wait, never negative
    assert dev.wait("F", 5.0, 5.0, 0.5) == 0.0
    with pytest.raises(ValueError, match="slowdown >= 0"):
        EmulatedDevice(-1.0)


def test_emulated_device_starts_deferred_work_at_its_emulated_time():
    clock = _FakeClock()
    dev = _device(3.0, clock)
    started = []
    clock.now = 0.25  # a gradient bucket is ready a quarter into the segment's CPU time ...
    dev.defer(lambda: started.append(clock.now))
    clock.now = 1.0  # ... the last one at its end
    dev.defer(lambda: started.append(clock.now))
    dev.wait("B", 0.0, 0.0, 1.0)  # emulated duration 1 + 3 x 1 = 4 s
    assert started == pytest.approx([1.0, 4.0]) and clock.now == pytest.approx(4.0)
    dev.defer(lambda: started.append("flushed"))
    dev.flush()
    assert started[-1] == "flushed"


def test_emulated_device_keeps_a_bounded_history():
    clock = _FakeClock()
    dev = _device(1.0, clock, max_keys=3)
    for n in range(10):  # e.g. a new sequence length every step
        dev.wait(("F", n), clock.now, clock.now, 0.1)
    assert list(dev._history) == [("F", 7), ("F", 8), ("F", 9)]


def test_whale_plan_command_prints_the_hardware_aware_plan(capsys):
    from whale.cli import main

    rc = main(["plan", "--model", "examples.gpt.model:for_plan", "--world", "4", "--micro-batches", "4",
               "--cluster", "examples/clusters/v100_p100.yaml", "--args", "n_layer=6", "n_embd=32", "seq_len=16"])
    out = capsys.readouterr().out
    assert rc == 0 and "hardware-aware" in out and "EMULATED" in out and "stage 0: F0 F1 B0" in out
    rc = main(["plan", "--model", "examples.gpt.model:for_plan", "--world", "2", "--json", "--args", "stages=1"])
    plan = wh.Plan.from_json(capsys.readouterr().out)
    assert rc == 0 and plan.num_lanes == 2


def test_whale_plan_bad_input_is_one_line(capsys, tmp_path):
    from whale.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - devices: [RTX-9999]\n")
    rc = main(["plan", "--model", "examples.gpt.model:for_plan", "--world", "1", "--cluster", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "bad.yaml" in err and "RTX-9999" in err
    rc = main(["plan", "--model", "examples.gpt.model:for_plan", "--world", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a multiple of 2" in err


def test_an_emulated_device_as_fast_as_its_core_still_gets_steady_times():
    def engine(spec):
        ctx = wh.Context(wh.Config(cluster=spec), 0, 1, torch.device("cpu"), spec)
        return wh.parallelize(TinyLM(), torch.nn.functional.cross_entropy, torch.optim.SGD, ctx=ctx)

    fastest = engine(_spec("V100-32GB", emulate=True))  # world of one on >= 1 core: slowdown 0, still emulated
    assert fastest.slowdown == 0.0 and fastest.grad_sync.scheduler is not None
    real = engine(_spec("V100-32GB"))
    assert real.slowdown is None and real.grad_sync.scheduler is None
    real.slowdown = 0.5
    assert real.slowdown == 0.5
    real.slowdown = None
    assert real.slowdown is None
    with pytest.raises(ValueError, match="slowdown must be >= 0"):
        real.slowdown = -1.0


def test_profiled_lane_shares_are_the_rows_that_run():
    spec = _spec("V100-32GB", "P100-16GB", "V100-32GB", "P100-16GB")
    plan = wh.plan_model(TinyLM(), 4, wh.Config(num_micro_batch=4, cluster=spec), sample_batch=_batch(32))
    rows = [b - a for (a, b) in (lane[0] for lane in plan.micro_batch_rows(32))]
    assert list(plan.lane_weights) == rows and sum(rows) == 8  # whole rows of one micro-batch
    times = [r / d for r, d in zip(rows, [15.7, 10.6, 15.7, 10.6], strict=True)]
    assert plan.predicted_utilization == pytest.approx([t / max(times) for t in times], rel=1e-6)


def test_explicit_load_shares_win_over_device_speed_and_say_so():
    spec = _spec("V100-32GB", "P100-16GB")
    plan = wh.plan_model(TinyLM(), 2, wh.Config(cluster=spec, load_shares=(1, 3)))
    assert plan.lane_weights == (1.0, 3.0) and "Config.load_shares" in str(plan)


def test_a_sample_batch_the_plan_cannot_run_is_refused_at_plan_time():
    with pytest.raises(wh.PlanError, match="does not divide into num_micro_batch=3"):
        wh.plan_model(TinyLM(stage_layers=(1, 1)), 2, wh.Config(num_micro_batch=3), sample_batch=_batch(32))
