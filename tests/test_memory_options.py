"""Memory options in the planner (no processes): per-rank predictions under each technique, and the choice of
the cheapest combination that fits, checked against brute force on random small instances."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from whale.config import Config, ConfigError
from whale.planner.balance import InfeasiblePlanError
from whale.planner.memory import (
    OFFLOADS,
    MemoryOptions,
    StageMemory,
    candidates,
    choose_memory_options,
    plan_memory,
    rank_memory,
    shortfalls,
)
from whale.planner.planner import TaskGraphSummary, make_plan
from whale.planner.steptime.memory_time import step_seconds

ALL = [MemoryOptions(c, z, o) for c, z, o in itertools.product((False, True), (0, 1, 2, 3), OFFLOADS)]


def _plan(stages: int, world: int, micro: int, weights=None):
    tgs = [TaskGraphSummary("replicate", None, (f"s{i}",), 1000) for i in range(stages)]
    plan = make_plan(tgs, world, Config(num_micro_batch=micro))
    return dataclasses.replace(plan, lane_weights=weights) if weights else plan


def _stage(rng: random.Random) -> StageMemory:
    e = rng.randint(10, 10_000)
    act = rng.uniform(1, 2000)
    k, extra = rng.uniform(0.05, 0.5), rng.uniform(0, 500)
    kept = act * k
    return StageMemory(trainable_elements=e, frozen_bytes=rng.uniform(0, 1000), activation_bytes=act,
                       checkpointed_bytes=kept, backward_bytes=act + extra,
                       checkpointed_backward_bytes=kept + act * rng.uniform(0.1, 1 - k) + extra,
                       gather_elements=rng.randint(1, e), recompute_flops=rng.uniform(1e3, 1e6),
                       train_flops=rng.uniform(1e6, 1e7))


def test_each_technique_never_adds_device_memory():
    rng = random.Random(1)
    for _ in range(200):
        st, rows, flight, share = _stage(rng), rng.randint(1, 8), rng.randint(1, 4), rng.uniform(0.05, 1.0)
        dev = {o: rank_memory(st, rows, flight, share, o).device_total for o in ALL}
        for o in ALL:
            for more in (dataclasses.replace(o, activation_checkpoint=True),  # ZeRO-2's peak holds its slice too
                         dataclasses.replace(o, zero=1) if o.zero == 0 else o,
                         dataclasses.replace(o, offload="optimizer") if o.offload == "none" else o):
                assert dev[more] <= dev[o] + 1e-9, (o, more)
    st = StageMemory(trainable_elements=1000, activation_bytes=10.0)
    none = rank_memory(st, 2, 1, 0.5, MemoryOptions())
    assert none.device == {"parameters": 4000, "gradients": 4000, "optimizer_state": 8000, "activations": 20,
                           "temporaries": 0}
    z1 = rank_memory(st, 2, 1, 0.5, MemoryOptions(zero=1))
    assert z1.device["optimizer_state"] == 4000 and z1.host == 0
    off = rank_memory(st, 2, 1, 0.5, MemoryOptions(zero=1, offload="optimizer"))
    assert off.device["optimizer_state"] == 0 and off.host == 16 * 500


def _brute(plan, stages, batch, floor, forbid, cap, host, speeds, bw):
    """Every combination by hand: the user's floor kept, forbidden additions dropped, cheapest fitting one."""
    def allowed(o):
        if o.activation_checkpoint < floor.activation_checkpoint or o.zero < floor.zero or \
                OFFLOADS.index(o.offload) < OFFLOADS.index(floor.offload) or \
                (o.offload == "optimizer+params" and o.zero in (1, 2)):
            return False
        added = {"activation_checkpoint": o.activation_checkpoint and not floor.activation_checkpoint,
                 "zero": o.zero > floor.zero, "zero3": o.zero == 3 and floor.zero < 3,
                 "offload": o.offload != floor.offload,
                 "offload_params": o.offload == "optimizer+params" and floor.offload != o.offload}
        return not any(added[f] for f in forbid)
    best = None
    for o in ALL:
        if not allowed(o):
            continue
        ranks = plan_memory(plan, stages, batch, o)
        ok = all(m.device_total <= c for m, c in zip(ranks, cap, strict=True)) and \
            all(m.host <= h for m, h in zip(ranks, host, strict=True))
        cost = step_seconds(plan, stages, batch, o, speeds, bw)
        if ok and o == floor:
            return cost, o  # what the user set fits: kept as is
        if ok and (best is None or cost < best[0] - 1e-15):
            best = (cost, o)
    return best


def test_choice_is_the_cheapest_fitting_combination_on_random_instances():
    rng = random.Random(0)
    checked = infeasible = 0
    worst = 1.0
    for _ in range(150):
        stages_n = rng.choice((1, 2))
        lanes = rng.choice((1, 2, 3))
        micro = rng.choice((1, 2, 4))
        plan = _plan(stages_n, stages_n * lanes, micro)
        stages = [_stage(rng) for _ in range(stages_n)]
        batch = micro * lanes * rng.randint(1, 3)
        cap = [rng.uniform(2e4, 2e5) for _ in range(plan.world_size)]
        host = [rng.uniform(0, 4e5) for _ in range(plan.world_size)]
        speeds = [rng.uniform(1e9, 1e10) for _ in range(plan.world_size)]
        floor = rng.choice([o for o in ALL[:6] if not (o.zero in (1, 2) and o.offload == "optimizer+params")])
        forbid = tuple(f for f in ("activation_checkpoint", "zero", "zero3", "offload", "offload_params")
                       if rng.random() < 0.2)
        expect = _brute(plan, stages, batch, floor, forbid, cap, host, speeds, 1e9)
        place = (lambda p: lambda _o: p)(plan)
        if expect is None:
            with pytest.raises(InfeasiblePlanError, match="no allowed combination"):
                choose_memory_options(place, stages, batch, floor, forbid, cap, host, speeds, 1e9)
            infeasible += 1
            continue
        got = choose_memory_options(place, stages, batch, floor, forbid, cap, host, speeds, 1e9)
        assert not shortfalls(list(got.ranks), cap, host)
        worst = max(worst, got.step_seconds / expect[0] if expect[0] > 0 else (1.0 if got.step_seconds == 0
                                                                                 else float("inf")))
        checked += 1
    print(f"{checked} feasible instances (+{infeasible} infeasible): worst extra-time ratio to brute force "
          f"{worst:.6f}")
    assert worst == pytest.approx(1.0) and checked > 50 and infeasible > 5


def test_floor_and_forbid_are_respected_and_reasons_name_the_shortfall():
    plan = _plan(1, 2, 1)
    stages = [StageMemory(trainable_elements=10_000, activation_bytes=100.0, checkpointed_bytes=10.0,
                          backward_bytes=150.0,
                          gather_elements=1000, recompute_flops=1e3)]
    need = plan_memory(plan, stages, 4, MemoryOptions())[0].device_total
    place = lambda _o: plan  # noqa: E731
    cap = [need * 0.8] * 2  # ZeRO-1 (optimizer halved) fits, nothing cheaper does
    got = choose_memory_options(place, stages, 4, MemoryOptions(), (), cap, [], [1e12] * 2, 1e12)
    assert got.options.zero >= 1 and "without it rank 0 needs" in "\n".join(got.reasons)
    forced = choose_memory_options(place, stages, 4, MemoryOptions(activation_checkpoint=True), (),
                                   [need * 10] * 2, [], [1e12] * 2, 1e12)
    assert forced.options == MemoryOptions(activation_checkpoint=True)  # what the user set is kept
    with pytest.raises(InfeasiblePlanError, match=r"Config.forbid=\('zero', 'offload'\)"):
        choose_memory_options(place, stages, 4, MemoryOptions(), ("zero", "offload"), cap, [], [1e12] * 2, 1e12)
    assert all(o.zero == 0 for o in candidates(MemoryOptions(), ("zero",)))
    with pytest.raises(ValueError, match="cannot forbid"):
        candidates(MemoryOptions(), ("recompute",))


def _gpt_plan(scale: float, **config):
    import torch

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig
    from whale.cluster import ClusterSpec

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, n_embd=128), stages=2)
    x = torch.randint(0, 2048, (16, 65))
    spec = ClusterSpec.from_dict({"emulate": True, "memory_scale": scale,
                                  "nodes": [{"devices": ["V100-32GB"] * 2}, {"devices": ["P100-16GB"] * 2}]})
    plan = wh.plan_model(model, 4, wh.Config(num_micro_batch=4, **config), sample_batch=(x[:, :-1], x[:, 1:]),
                         cluster=spec, loss_fn=wh.token_cross_entropy())
    return plan, spec


def test_planner_adds_the_cheapest_techniques_when_the_plan_does_not_fit_and_says_why():
    from whale.cluster import memory_capacity

    roomy, _ = _gpt_plan(1.0)
    assert roomy.zero == 0 and not roomy.activation_checkpoint and not any("memory:" in n for n in roomy.notes)
    tight, spec = _gpt_plan(0.7e-3)  # a P100 holds 11.2 MB: the GPT's AdamW state and activations do not fit
    assert tight.zero or tight.activation_checkpoint
    assert all(m <= memory_capacity(spec, r) for r, m in enumerate(tight.predicted_memory))
    text = str(tight)
    assert "memory: chosen because without it rank" in text and "of device memory, has" in text
    offloaded, _ = _gpt_plan(0.7e-3, forbid=("activation_checkpoint", "zero"))
    assert offloaded.offload == "optimizer" and "offload optimizer" in str(offloaded)
    with pytest.raises(InfeasiblePlanError, match="no allowed combination of memory techniques fits"):
        _gpt_plan(0.7e-3, forbid=("activation_checkpoint", "zero", "offload"))
    with pytest.raises(ConfigError, match="cannot be forbidden"):
        Config(forbid=("recompute",))


def test_zero3_pipeline_stage_holds_shard_tied_weights_and_the_gathered_rest():
    """A pipeline stage under ZeRO-3 (measured in benchmarks/memory.py): its own shard, the cross-stage tied
    weights whole, the rest of the stage gathered; gradients reduce-scattered as the stage's backward ends."""
    st = StageMemory(trainable_elements=1000, tied_elements=200, tie_stages=2, gather_elements=800,
                     activation_bytes=10.0, backward_bytes=30.0, pipelined=True)
    r = rank_memory(st, rows=4, in_flight=1, share=0.5, options=MemoryOptions(zero=3)).device
    assert r["parameters"] == 4 * (0.5 * 800 + 200 + 800)
    assert r["gradients"] == 4 * (0.5 * 800 + 200)
    assert r["optimizer_state"] == 8 * 0.5 * (800 + 100)
    assert r["temporaries"] == 4 * 20.0
    one = dataclasses.replace(st, pipelined=False, tied_elements=0, gather_elements=300)
    r = rank_memory(one, rows=4, in_flight=1, share=0.5, options=MemoryOptions(zero=3)).device
    assert r["parameters"] == r["gradients"] == 4 * (0.5 * 1000 + 300)


def test_zero3_with_parameter_offload_leaves_the_device_only_what_is_gathered():
    st = StageMemory(trainable_elements=1000, activation_bytes=10.0, gather_elements=300, reduce_elements=200)
    shard = rank_memory(st, 1, 1, 0.25, MemoryOptions(zero=3, offload="optimizer"))
    hosted = rank_memory(st, 1, 1, 0.25, MemoryOptions(zero=3, offload="optimizer+params"))
    assert shard.device["parameters"] == shard.device["gradients"] == 4 * 250 + 4 * 300  # shard + gathered
    assert hosted.device["parameters"] == hosted.device["gradients"] == 4 * 300  # the shards are on the host
    assert hosted.device["temporaries"] == shard.device["temporaries"] == 4 * 200  # a flat buffer in reduction
    assert hosted.host == shard.host == 16 * 250  # the shard is the master, its gradient the host buffer
    tied = dataclasses.replace(st, tied_elements=100, tie_stages=2, pipelined=True)
    assert rank_memory(tied, 1, 1, 0.25, MemoryOptions(zero=3, offload="optimizer+params")).device[
        "parameters"] == 4 * 100 + 4 * 300  # weights tied across stages stay whole on the device
    got = candidates(MemoryOptions())
    assert MemoryOptions(True, 3, "optimizer+params") in got
    assert not [o for o in got if o.offload == "optimizer+params" and o.zero in (1, 2)]
    assert MemoryOptions(True, 3, "optimizer+params") not in candidates(MemoryOptions(), ("offload_params",))
    assert Config(zero=3, offload="optimizer+params").offload == "optimizer+params"
    with pytest.raises(ConfigError, match="zero=3"):
        Config(zero=2, offload="optimizer+params")
