"""``Plan.chunk_positions``: an interleaved plan whose stages hold different chunk counts (the stage of every
chunk), validated, serialized like every other field, read by the layout, printed with chunks per stage; and
the planner's ties follow the map."""

from __future__ import annotations

import dataclasses
import json

import pytest

import whale as wh
from tests.models import TinyLM
from whale.plan.plan import SharedParam
from whale.plan.schedule import in_flight_micro_batches, max_in_flight
from whale.plan.schedule_chunks import chunked_1f1b, schedule_for
from whale.planner.planner import TaskGraphSummary, make_plan


def _plan() -> wh.Plan:
    """TinyLM with 4 chunk scopes on 2 stages, interleaved, v = 2 (round-robin as annotated)."""
    config = wh.Config(num_micro_batch=2, schedule="Interleaved1F1B", virtual_stages=2)
    return wh.plan_model(TinyLM(stage_layers=(1, 1, 1, 1), tied=False), 2, config)


def test_the_map_is_a_validated_serialized_field():
    plan = dataclasses.replace(_plan(), chunk_positions=(0, 1, 0, 0))
    assert wh.Plan.from_json(plan.to_json()) == plan and json.loads(plan.to_json())["chunk_positions"] == [0, 1, 0, 0]
    assert [plan.position_of(c) for c in range(4)] == [0, 1, 0, 0]
    assert (plan.chunks_of(0), plan.chunks_of(1)) == ([0, 2, 3], [1])
    assert [tg.index for tg in plan.stage_task_graphs(0)] == [0, 2, 3]
    assert schedule_for(plan.schedule, 2, 2, 2, plan.chunk_positions) == chunked_1f1b((0, 1, 0, 0), 2)
    rr = _plan()
    assert rr.chunk_positions == () and [rr.position_of(c) for c in range(4)] == [0, 1, 0, 1]
    for bad in ((0, 1, 0), (0, 0, 0, 0), (0, 1, 2, 0), (1, 0, 0, 0)):
        with pytest.raises(wh.PlanError, match="chunk_positions"):
            dataclasses.replace(rr, chunk_positions=bad)
    with pytest.raises(wh.PlanError, match="chunk_positions"):
        wh.Plan.from_dict({**rr.to_dict(), "chunk_positions": ["0"] * 4})


def test_the_printout_shows_chunks_per_stage():
    text = str(dataclasses.replace(_plan(), chunk_positions=(0, 1, 0, 0)))
    assert "with 3+1 chunks per stage (TaskGraph c on stage chunk_positions[c] = [0, 1, 0, 0])" in text
    assert "stage 0: 3 chunks: 0, 2, 3" in text and "stage 1: 1 chunk: 1" in text
    assert "chunk 3 (stage 0)" in text
    assert "stage 0: 2 chunks: 0, 2" in str(_plan())


def test_make_plan_puts_ties_on_the_stages_of_the_map():
    """A tie between chunks 0 and 3: across stages 0 and 1 round-robin, one tensor on stage 0 under (0, 1, 0, 0)."""
    tgs = [TaskGraphSummary("replicate", 1) for _ in range(4)]
    config = wh.Config(num_micro_batch=2, schedule="Interleaved1F1B", virtual_stages=2)
    tie = (SharedParam(("emb.weight", "head.weight"), (0, 3)),)
    assert make_plan(tgs, 2, config, shared_params=tie).shared_params[0].stages == (0, 1)
    assert make_plan(tgs, 2, config, shared_params=tie, chunk_positions=(0, 1, 0, 0)).shared_params == ()


def test_activations_in_flight_follow_each_stages_chunks():
    """The memory model's micro-batches in flight (Plan.in_flight): the interleaved closed form with the plan's
    v (stage 1 of p = 2, v = 2, m = 2 holds 3 chunk micro-batches of 1/2 the stage: 1.5, not 1F1B's 1), and
    under a chunk map the built schedule's peak over each stage's chunks."""
    rr = _plan()
    assert [rr.in_flight(s) for s in range(2)] == [in_flight_micro_batches(s, 2, 2, "Interleaved1F1B", 2)
                                                   for s in range(2)]
    assert rr.in_flight(1) == 1.5
    plan = dataclasses.replace(rr, chunk_positions=(0, 1, 0, 0))
    sched = chunked_1f1b((0, 1, 0, 0), 2)
    assert [plan.in_flight(s) for s in range(2)] == [max_in_flight(sched[0]) / 3, max_in_flight(sched[1]) / 1]
    with pytest.raises(ValueError, match="outside"):
        plan.in_flight(2)
