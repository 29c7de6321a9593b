"""The step-time model prices interleaved 1F1B plans (``virtual_stages > 1``, optionally ``chunk_positions``):
costs per model chunk, summed per stage with each chunk's share passed to the schedule simulation, transfers
only between chunks on different stages (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import whale as wh
from tests.models import TinyLM, lm_loss
from whale.frontend import hwplan
from whale.frontend.simcost import model_costs, stage_units
from whale.plan.plan import Plan, TaskGraph
from whale.plan.schedule_chunks import schedule_for
from whale.plan.schedule_sim import simulate_lanes
from whale.planner.calibration_cache import Calibration
from whale.planner.memory_types import StageMemory, merge_chunks
from whale.planner.steptime import cost
from whale.planner.steptime.simulate import StageCost, predict, segment_seconds

CAL = Calibration(key="test", p2p_latency=1e-4, p2p_bandwidth=1e9, allreduce_latency=1e-4, allreduce_bandwidth=1e9,
                  optimizer_seconds_per_element=1e-8, segment_overhead=1e-4, step_overhead=0.0)
CHUNK = StageCost(fwd_per_row=1e-3, bwd_per_row=2e-3, fwd_overhead=1e-4, boundary_bytes=1e4,
                  trainable_elements=50_000)


def _plan(p: int = 2, v: int = 2, m: int = 4, positions: tuple[int, ...] = (), schedule="Interleaved1F1B") -> Plan:
    """p stages of one device, v chunks each (p * v TaskGraphs), m micro-batches."""
    tgs = tuple(TaskGraph(c, "replicate", 1) for c in range(p * v))
    return Plan(world_size=p, task_graphs=tgs, num_replicas=1, num_micro_batch=m, schedule=schedule,
                virtual_stages=v, chunk_positions=positions)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 3, 4), (4, 2, 8)])
def test_equal_chunks_round_robin_match_the_lane_simulation(p, v, m):
    """Equal chunks, round robin: the predicted schedule is simulate_lanes' with the chunks' summed seconds per
    stage and the p2p formula on every stage (the last one's is the wrap-around to stage 0)."""
    plan, batch = _plan(p, v, m), 8 * m
    pred = predict(plan, [CHUNK] * (p * v), None, CAL, batch)
    f, b = segment_seconds(CHUNK, batch // m, 1.0, CAL)
    comm = cost.p2p_time(batch // m * CHUNK.boundary_bytes, CAL.p2p_bandwidth, CAL.p2p_latency)
    sim = simulate_lanes(schedule_for("Interleaved1F1B", p, m, v), [[[v * f] * m]] * p, [[[v * b] * m]] * p,
                         [[comm]] * p)
    assert pred.schedule == pytest.approx(max(max(e) for e in sim["end"]))
    assert pred.stage_fwd == pytest.approx((v * f,) * p) and pred.stage_bwd == pytest.approx((v * b,) * p)
    assert pred.step > pred.schedule and len(pred.rank_busy) == p
    # one cost per stage (the old form) still works: the same stage seconds, but one segment overhead per stage
    merged = StageCost(**{**CHUNK.__dict__, "fwd_per_row": v * CHUNK.fwd_per_row,
                          "bwd_per_row": v * CHUNK.bwd_per_row, "fwd_overhead": v * CHUNK.fwd_overhead})
    assert predict(plan, [merged] * p, None, CAL, batch).schedule < pred.schedule


def test_a_chunk_map_is_priced_and_its_local_hand_offs_are_free():
    """chunk_positions (0, 1, 0, 0): stage 0 runs chunks 0, 2, 3; the hand-off 2 -> 3 stays on stage 0, so its
    bytes cost nothing; the shares follow the chunks' seconds."""
    plan = _plan(positions=(0, 1, 0, 0))
    heavy = dataclasses.replace(CHUNK, fwd_per_row=4e-3)
    costs = [CHUNK, CHUNK, heavy, dataclasses.replace(CHUNK, boundary_bytes=0.0)]
    pred = predict(plan, costs, None, CAL, 32)
    f = [segment_seconds(c, 8, 1.0, CAL)[0] for c in costs]
    assert pred.stage_fwd == pytest.approx((f[0] + f[2] + f[3], f[1]))
    huge = predict(plan, [CHUNK, CHUNK, dataclasses.replace(heavy, boundary_bytes=1e12), costs[3]], None, CAL, 32)
    assert huge.schedule == pytest.approx(pred.schedule)
    slow_link = predict(plan, [dataclasses.replace(CHUNK, boundary_bytes=1e9)] + costs[1:], None, CAL, 32)
    assert slow_link.schedule > pred.schedule + 1.0  # 0 -> 1 crosses stages: 8e9 bytes at 1 GB/s
    mem = [StageMemory(trainable_elements=1000, activation_bytes=10.0, backward_bytes=15.0)] * 4
    with_mem = predict(plan, costs, None, CAL, 32, memory=mem)
    assert len(with_mem.peak_bytes) == 2 and with_mem.peak_bytes[0] > with_mem.peak_bytes[1]
    with pytest.raises(ValueError, match="one per stage or one per chunk"):
        predict(plan, costs[:3], None, CAL, 32)


def test_merged_chunk_memory_adds_static_bytes_and_keeps_the_worst_backward_excess():
    a = StageMemory(trainable_elements=10, frozen_bytes=4.0, activation_bytes=2.0, backward_bytes=5.0, p2p_bytes=1.0)
    b = StageMemory(trainable_elements=20, frozen_bytes=1.0, activation_bytes=3.0, backward_bytes=4.0, p2p_bytes=1.0)
    m = merge_chunks([a, b])
    assert (m.trainable_elements, m.frozen_bytes, m.activation_bytes, m.p2p_bytes) == (30, 5.0, 5.0, 2.0)
    assert m.backward_bytes == 5.0 + 3.0 and merge_chunks([a]) is a


def test_zb_h1_and_1f1b_stay_priced():
    for kind in ("ZB-H1", "1F1B"):
        plan = _plan(v=1, schedule=kind)
        pred = predict(plan, [CHUNK] * 2, None, CAL, 32)
        assert pred.step > pred.schedule > 0 and pred.comm["p2p"] > 0


def test_model_costs_of_an_interleaved_plan_are_per_chunk_and_predict():
    """A real model's interleaved plan (TinyLM, 4 chunk scopes on 2 stages): one cost per chunk, the loss on the
    last chunk, priced round robin and under the map (0, 1, 0, 0)."""
    model = TinyLM(stage_layers=(1, 1, 1, 1), tied=False)
    config = wh.Config(num_micro_batch=2, schedule="Interleaved1F1B", virtual_stages=2)
    x = torch.zeros(4, 8, dtype=torch.long)
    rr = wh.plan_model(model, 2, config)
    units = stage_units(hwplan.profile(model, (x, x), loss_fn=lm_loss), rr, model)
    assert len(units) == 4 and units[-1][-1].name == "<rest>" and all(u.name != "<rest>" for u in units[2])
    for plan in (rr, dataclasses.replace(rr, chunk_positions=(0, 1, 0, 0))):
        costs, mems, calib = model_costs(model, plan, (x, x), lm_loss, CAL)
        assert len(costs) == len(mems) == 4 and costs[-1].boundary_bytes == 0 < costs[0].boundary_bytes
        pred = predict(plan, costs, None, calib, 4, mems)
        assert pred.step > 0 and len(pred.stage_fwd) == 2 and len(pred.peak_bytes) == 2


def test_whale_simulate_prices_an_interleaved_plan(tmp_path, monkeypatch, capsys):
    """``whale simulate --schedule Interleaved1F1B --virtual-stages 2`` on a GPT of 4 stage scopes over 2 ranks
    (calibration and engine fit seeded: no processes)."""
    from examples.gpt.model import for_plan
    from whale.cli import main
    from whale.frontend.unit_keys import unit_keys
    from whale.planner.calibration_cache import MODEL_ENGINE_VERSION, EngineTiming, machine_key, model_signature, save

    kw = {"n_layer": 4, "n_embd": 16, "n_head": 2, "vocab_size": 64, "seq_len": 8, "batch": 4, "stages": 4}
    model, batch, loss = for_plan(**kw)
    sig = model_signature(unit_keys(model, batch, hwplan.profile(model, batch, loss_fn=loss), loss, tracked=False))
    path = tmp_path / "cal.json"
    save(Calibration(key=machine_key(), p2p_bandwidth=2e9, optimizer_seconds_per_element=1e-8,
                     engine=EngineTiming(), model_engines={sig: EngineTiming(version=MODEL_ENGINE_VERSION)}), path)
    monkeypatch.setenv("WHALE_CALIBRATION", str(path))
    rc = main(["simulate", "--model", "examples.gpt.model:for_plan", "--world", "2", "--micro-batches", "2",
               "--schedule", "Interleaved1F1B", "--virtual-stages", "2", "--png", "",
               "--args", *[f"{k}={v}" for k, v in kw.items()]])
    out = capsys.readouterr().out
    assert rc == 0 and "predicted step" in out and "Interleaved1F1B" in out
