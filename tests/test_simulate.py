"""The whole-step time model: simulator over lanes, communication formulas, predictions, calibration cache, and
the ``whale simulate`` command (no processes except the CLI's one-off calibration, which is pre-seeded)."""

from __future__ import annotations

import json
import math

import pytest

from whale.cluster import ClusterSpec, from_device_types, get_device_type
from whale.plan.plan import Plan, TaskGraph
from whale.plan.schedule import bubble_fraction, make_schedule
from whale.plan.schedule_sim import simulate, simulate_lanes
from whale.planner.calibration_cache import (
    MODEL_ENGINE_VERSION,
    Calibration,
    EngineTiming,
    UnitTiming,
    load,
    machine_key,
    save,
)
from whale.planner.steptime import cost
from whale.planner.steptime.simulate import StageCost, predict, speed_factors


@pytest.mark.parametrize("kind", ["1F1B", "GPipe"])
@pytest.mark.parametrize("p,m,lanes", [(2, 1, 1), (2, 4, 2), (3, 5, 1), (4, 8, 3)])
def test_equal_stages_reproduce_the_bubble_on_every_lane(kind, p, m, lanes):
    f, b = 1.0, 2.0
    out = simulate_lanes(make_schedule(kind, p, m), [[[f] * m] * lanes] * p, [[[b] * m] * lanes] * p,
                         [[0.0] * lanes] * p)
    step = max(max(e) for e in out["end"])
    assert step == pytest.approx((m + p - 1) * (f + b))
    for s in range(p):
        for lane in range(lanes):
            assert 1 - out["busy"][s][lane] / step == pytest.approx(bubble_fraction(p, m))
    one = simulate(make_schedule(kind, p, m), [f] * p, [b] * p)
    assert one["idle_share"][0] == pytest.approx(bubble_fraction(p, m))


def test_a_slow_lane_delays_only_its_own_path_and_transfers_add_latency():
    sched = make_schedule("1F1B", 2, 2)
    fwd = [[[1.0, 1.0], [2.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]]]
    bwd = [[[1.0, 1.0], [2.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]]]
    free = simulate_lanes(sched, fwd, bwd, [[0.0, 0.0], [0.0, 0.0]])
    slow = simulate_lanes(sched, fwd, bwd, [[0.5, 0.5], [0.0, 0.0]])
    assert free["end"][0][1] > free["end"][0][0]
    assert slow["end"][0][0] > free["end"][0][0]
    with pytest.raises(ValueError, match="stage"):
        simulate_lanes(sched, fwd[:1], bwd, [[0.0]])


def test_collective_formulas():
    assert cost.ring_reduce_scatter_time(8e6, 4, 1e9, 1e-5) == pytest.approx(0.75 * 8e6 / 1e9 + 3e-5)
    assert cost.all_to_all_time(8e6, 4, 1e9, 1e-5) == pytest.approx(6e-3 + 3e-5)
    assert cost.all_to_all_time(8e6, 1, 1e9, 1e-5) == 0.0
    # two buckets ready at 0 and 10 s: the second starts when it is ready, not when the first is done
    one = cost.ring_allreduce_time(1e9, 2, 1e9)
    assert cost.bucketed_allreduce_finish([0.0, 10.0], [1e9, 1e9], 2, 1e9) == pytest.approx(10.0 + one)
    assert cost.bucketed_allreduce_finish([0.0, 0.0], [1e9, 1e9], 2, 1e9) == pytest.approx(2 * one)
    assert cost.offload_time(16e9, 16e9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="bucket"):
        cost.bucketed_allreduce_finish([0.0], [1.0, 2.0], 2, 1e9)


def test_cluster_latency_defaults_yaml_and_errors():
    spec = ClusterSpec.from_dict({"nodes": [{"devices": ["V100-32GB"] * 2}, {"devices": ["P100-16GB"]}],
                                  "inter_node_latency": 1e-4})
    assert spec.link_latency(0, 1) == spec.intra_node_latency and spec.link_latency(0, 2) == 1e-4
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="intra_node_latency"):
        ClusterSpec.from_dict({"nodes": [{"devices": ["T4"]}], "intra_node_latency": -1})


def _pipe(stages: int, m: int, lanes: int = 1, devices=None) -> Plan:
    tgs = tuple(TaskGraph(s, "replicate", lanes) for s in range(stages))
    return Plan(world_size=stages * lanes, task_graphs=tgs, num_replicas=1, num_micro_batch=m,
                devices=tuple(devices or ()))


CAL = Calibration(key="test", p2p_latency=1e-4, p2p_bandwidth=1e9, allreduce_latency=1e-4, allreduce_bandwidth=1e9,
                  optimizer_seconds_per_element=1e-8, segment_overhead=0.0, step_overhead=0.0)
STAGE = StageCost(fwd_per_row=1e-3, bwd_per_row=2e-3, boundary_bytes=1e4, trainable_elements=100_000)


def test_prediction_is_consistent_and_monotone():
    base = predict(_pipe(2, 4), [STAGE] * 2, None, CAL, 32)
    assert base.step >= max(base.rank_busy) and base.step >= base.schedule
    assert all(i == pytest.approx(base.step - b) for i, b in zip(base.rank_idle, base.rank_busy, strict=True))
    assert base.stage_fwd[0] == pytest.approx(8 * 1e-3)  # 32 rows / 4 micro-batches
    more_mb = predict(_pipe(2, 8), [STAGE] * 2, None, CAL, 32)
    assert more_mb.schedule < base.schedule  # a smaller bubble
    assert predict(_pipe(2, 4), [STAGE] * 2, None, CAL, 64).step > base.step
    heavy = StageCost(**{**STAGE.__dict__, "bwd_per_row": 4e-3})
    assert predict(_pipe(2, 4), [STAGE, heavy], None, CAL, 32).step > base.step
    dp = predict(_pipe(1, 1, 2), [STAGE], None, CAL, 32)
    assert dp.comm["allreduce"] > 0 and dp.comm["p2p"] == 0
    with pytest.raises(ValueError, match="stage costs"):
        predict(_pipe(2, 4), [STAGE], None, CAL, 32)


def test_emulated_speed_factors_follow_the_declared_devices_and_cores():
    mixed = from_device_types([get_device_type("V100-32GB"), get_device_type("P100-16GB")], emulate=True)
    f = speed_factors(mixed, CAL, 2, cores=1.0)
    assert f[0] == pytest.approx(2.0) and f[1] == pytest.approx(2.0 * 15.7 / 10.6)
    slow = predict(_pipe(2, 4, devices=["V100-32GB", "P100-16GB"]), [STAGE] * 2, mixed, CAL, 32, cores=1.0)
    fast = predict(_pipe(2, 4), [STAGE] * 2, None, CAL, 32)
    assert slow.step > fast.step and slow.emulated and not fast.emulated
    real = from_device_types([get_device_type("H100-80GB")] * 2)
    cal = CAL.with_units({"x": UnitTiming(1e-3, 2e-3, fwd_per_flop=1e-10, bwd_per_flop=1e-10)})
    assert speed_factors(real, cal, 2)[0] == pytest.approx(1 / (1e-10 * 67e12 * 0.5))
    with pytest.raises(ValueError, match="cores"):
        speed_factors(mixed, CAL, 2, cores=0.0)


def test_zero_offload_and_checkpointing_add_their_costs():
    plan = _pipe(1, 2, 2)
    base = predict(plan, [STAGE], None, CAL, 32)
    import dataclasses

    z3 = predict(dataclasses.replace(plan, zero=3), [STAGE], None, CAL, 32)
    assert z3.comm["allgather"] > 0 and z3.step > base.step
    off = predict(dataclasses.replace(plan, offload="optimizer"), [STAGE], None, CAL, 32)
    assert off.comm["offload"] > 0
    ck = StageCost(**{**STAGE.__dict__, "recompute_per_row": 1e-3})
    with_ckpt = predict(dataclasses.replace(plan, activation_checkpoint=("a",)), [ck], None, CAL, 32)
    assert with_ckpt.stage_bwd[0] == pytest.approx(base.stage_bwd[0] + 8 * 1e-3)  # 8 rows per micro-batch and lane


def test_calibration_cache_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    cal = CAL.with_units({"k": UnitTiming(1.0, 2.0, 0.1, 0.2, 1e-9, 2e-9)})
    save(cal, path)
    assert load("test", path) == cal and load("other", path) is None
    assert load("test", tmp_path / "missing.json") is None
    assert "torch" in machine_key()
    with pytest.raises(ValueError, match="unknown calibration field"):
        Calibration.from_dict({"bogus": 1})


def _gpt_signature() -> str:
    """The model signature of the CLI test's GPT (its engine fit is seeded: no processes are spawned)."""
    from examples.gpt.model import for_plan
    from whale.frontend import hwplan
    from whale.frontend.unit_keys import unit_keys
    from whale.planner.calibration_cache import model_signature

    model, batch, loss = for_plan(n_layer=2, n_embd=16, n_head=2, vocab_size=64, seq_len=8, batch=4)
    return model_signature(unit_keys(model, batch, hwplan.profile(model, batch, loss_fn=loss), loss, tracked=True))


def test_whale_simulate_prints_the_prediction_and_writes_a_timeline(tmp_path, monkeypatch, capsys):
    from whale.cli import main

    path = tmp_path / "cal.json"
    fit = EngineTiming(version=MODEL_ENGINE_VERSION)
    save(Calibration(key=machine_key(), p2p_bandwidth=2e9, optimizer_seconds_per_element=1e-8,
                     engine=EngineTiming(fwd_scale=1.5), model_engines={_gpt_signature(): fit}), path)
    monkeypatch.setenv("WHALE_CALIBRATION", str(path))
    png = tmp_path / "t.png"
    rc = main(["simulate", "--model", "examples.gpt.model:for_plan", "--world", "2", "--micro-batches", "2",
               "--cluster", "benchmarks/clusters/v100_p100_2.yaml", "--png", str(png), "--cores", "2",
               "--args", "n_layer=2", "n_embd=16", "n_head=2", "vocab_size=64", "seq_len=8", "batch=4"])
    out = capsys.readouterr().out
    assert rc == 0 and "predicted step" in out and "EMULATED" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    cached = json.loads(path.read_text())[machine_key()]
    assert any(k.endswith("|tracked") for k in cached["units"])  # emulated runs track memory: timed so
    assert math.isclose(cached["p2p_bandwidth"], 2e9)  # the seeded comm costs were kept (no processes)
