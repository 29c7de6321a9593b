"""The plan as data: layout, apportioning, JSON round trip, printout and validation (no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import whale as wh
from whale.plan.plan import NestedScope, Plan, PlanError, SharedParam, StageCut, TaskGraph
from whale.plan.shares import whole_shares
from whale.planner.planner import TaskGraphSummary, make_plan


def _plan(counts=(1, 1), world=4, **cfg):
    tgs = [TaskGraphSummary("replicate", c, (f"m{i}",), 10) for i, c in enumerate(counts)]
    return make_plan(tgs, world, wh.Config(**cfg))


@given(st.integers(0, 10_000), st.lists(st.floats(0.01, 100), min_size=1, max_size=16))
def test_apportion_is_exact_and_optimal(total, weights):
    shares = whole_shares(total, weights)
    assert sum(shares) == total
    wsum = sum(weights)
    for s, w in zip(shares, weights, strict=True):
        assert s >= int(total * w / wsum - 1e-9)  # at least the lower quota
    last = max((k * (1.0 / w) for k, w in zip(shares, weights, strict=True) if k), default=0.0)
    assert last <= min((k + 1) * (1.0 / w) for k, w in zip(shares, weights, strict=True))  # min-max optimal


def test_rank_layout_dp_times_pp():
    plan = _plan((1, 1), world=4, num_micro_batch=4)
    assert plan.num_replicas == 2 and plan.num_lanes == 2
    assert plan.stage_ranks(0) == [0, 2] and plan.stage_ranks(1) == [1, 3]
    for r in range(4):
        assert plan.rank_of(*plan.coords(r)) == r


def test_micro_batch_rows_uneven_shares():
    plan = _plan((4,), world=4, load_shares=(1, 2, 3, 2), num_micro_batch=2)
    rows = plan.micro_batch_rows(16)
    assert rows[0] == [(0, 1), (8, 9)]
    assert rows[2] == [(3, 6), (11, 14)]
    assert sum(b - a for lane in rows for a, b in lane) == 16


def test_json_round_trip_and_printout():
    plan = _plan((1, 1), world=4, num_micro_batch=4, load_shares=(3, 1))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    text = str(plan)
    assert "4 rank(s) = 2 pipeline stages of 1 device(s) x 2 replicas" in text and "schedule 1F1B" in text
    assert "lane 0: 75.0%" in text


def _full_plan() -> Plan:
    nested = NestedScope("split", None, ("blocks.1.mlp",), (2.0, 1.0))
    tgs = (TaskGraph(0, "replicate", 2, ("emb", "blocks.0"), 100),
           TaskGraph(1, "replicate", 2, ("blocks.1", "head"), 50, (nested,)))
    cuts = (StageCut(("emb", "blocks_0"), ("emb.weight",), (), ("emb", "blocks.0")),
            StageCut(("blocks_1", "head"), ("head.weight",), ("blocks.1.ln.running",)))
    return Plan(8, tgs, 2, 4, "GPipe", (1.0, 2.0, 3.0, 4.0), (SharedParam(("emb.weight", "head.weight"), (0, 1)),),
                cuts, ("blocks.1.mlp",), False, tuple(range(7, -1, -1)), ("V100-32GB",) * 8, (1.0,) * 8,
                (10.0, 20.0), ("a note",))


def test_every_field_round_trips_through_json_and_the_plan_is_frozen():
    plan = _full_plan()
    assert Plan.from_json(plan.to_json()) == plan
    assert isinstance(Plan.from_json(plan.to_json()).task_graphs[1].nested[0], NestedScope)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.lane_weights = (1.0,) * 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.task_graphs[0].kind = "split"
    changed = dataclasses.replace(plan, lane_weights=(1.0,) * 4)
    assert changed.lane_weights == (1.0,) * 4 and plan.lane_weights == (1.0, 2.0, 3.0, 4.0)


def test_json_with_unknown_fields_or_kinds_is_refused():
    data = _full_plan().to_dict()
    with pytest.raises(PlanError, match=r"unknown fields \['zzz'\]"):
        Plan.from_dict({**data, "zzz": 1})
    data["task_graphs"][0]["kind"] = "shard"
    with pytest.raises(PlanError, match="kind 'shard' is unknown"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="not a JSON plan"):
        Plan.from_json("{")


def test_printout_names_the_parallelism_and_defines_its_columns():
    split_only = make_plan([TaskGraphSummary("split", None, ("fc",), 10)], 2, wh.Config())
    assert "split over 2 device(s)" in str(split_only) and "data parallel" not in str(split_only)
    pipeline = _plan((1, 1), world=2, num_micro_batch=2)
    assert "lane 0" not in str(pipeline)
    dp = _plan((2,), world=2)
    assert "2-way data parallel" in str(dp) and "replicas" not in str(dp)
    text = str(_full_plan())
    assert "busy: predicted share of the step" in text and "emb.weight = head.weight" in text
    assert "TG 1 nested split shard shares: 66.7%  33.3%" in text


def test_device_counts_that_do_not_fit_the_world():
    with pytest.raises(PlanError, match=r"replicate\(3\) \+ replicate\(2\) need 3\+2 = 5 devices per replica but "
                                        r"world size 4 is not a multiple of 5"):
        _plan((3, 2), world=4)
    with pytest.raises(PlanError, match=r"replicate\(3\) needs 3 devices per replica but world size 4"):
        _plan((3,), world=4)


def test_unequal_stage_widths_get_lanes_per_stage():
    plan = _plan((2, 1), world=3)  # a batch bridge re-splits rows between them (tests/test_widths.py)
    assert plan.stage_widths == (2, 1) and plan.stage_lane_weights == ((1.0, 1.0), (1.0,))


def test_batch_not_divisible_into_micro_batches():
    with pytest.raises(PlanError, match=r"does not divide into num_micro_batch=3.* at least 6 rows .* e\.g\. 9"):
        _plan((2,), world=2, num_micro_batch=3).micro_batch_rows(8)


def test_batch_smaller_than_data_parallel_ranks():
    with pytest.raises(PlanError, match="4 data-parallel ranks"):
        _plan((4,), world=4).micro_batch_rows(3)


def test_load_shares_of_wrong_length():
    with pytest.raises(PlanError, match="load_shares has 3 entries but the plan has 2"):
        _plan((2,), world=2, load_shares=(1, 1, 1))


def test_validation_on_load():
    bad = _plan((1, 1), world=2).to_json().replace('"num_replicas": 1', '"num_replicas": 3')
    with pytest.raises(PlanError, match="world size"):
        Plan.from_json(bad)


def test_task_graph_is_plain_data():
    tg = TaskGraph(0, "replicate", 2, ("blocks",), 5)
    assert Plan(2, (tg,), 1).task_graphs[0] == tg


@pytest.mark.parametrize("field,value,match", [
    ("num_micro_batch", 0, "must be >= 1"),
    ("schedule", "zigzag", "unknown"),
    ("load_shares", (1, -1), "numbers > 0"),
    ("bucket_cap_mb", 0, "bucket_cap_mb"),
])
def test_config_errors(field, value, match):
    with pytest.raises(wh.ConfigError, match=match):
        wh.Config(**{field: value})


class _Drop:
    """The "delete this field" edit; its repr is the test id, the same in every pytest-xdist worker."""

    def __repr__(self) -> str:
        return "<drop>"


_DROP = _Drop()


def _edit(path: str, value):
    """An edit of a plan's ``to_dict()``: set (or, with ``_DROP``, delete) the dotted ``path`` (list indices as
    numbers)."""
    def apply(data: dict) -> None:
        *head, last = path.split(".")
        for key in head:
            data = data[int(key)] if key.isdigit() else data[key]
        if value is _DROP:
            del data[last]
        else:
            data[last] = value
    return apply


INF, NAN = float("inf"), float("nan")
BAD_PLAN_DATA = [  # (path, bad value, regex the message must match: the field's path and the bad value)
    # unknown and missing fields inside the parts
    ("task_graphs.0.foo", 1, r"task_graphs\[0\] has unknown fields \['foo'\]; TaskGraph fields are"),
    ("task_graphs.1.nested.0.foo", 1, r"task_graphs\[1\]\.nested\[0\] has unknown fields \['foo'\]"),
    ("shared_params.0.foo", 1, r"shared_params\[0\] has unknown fields \['foo'\]"),
    ("stage_cuts.1.foo", 1, r"stage_cuts\[1\] has unknown fields \['foo'\]"),
    ("task_graphs.0.device_count", _DROP, r"task_graphs\[0\] lacks required fields \['device_count'\]; add"),
    ("task_graphs.1.nested.0.device_count", _DROP, r"task_graphs\[1\]\.nested\[0\] lacks required .*device_count"),
    ("shared_params.0.stages", _DROP, r"shared_params\[0\] lacks required fields \['stages'\]"),
    ("stage_cuts.0.nodes", _DROP, r"stage_cuts\[0\] lacks required fields \['nodes'\]"),
    ("world_size", _DROP, r"plan data lacks required fields \['world_size'\]"),
    # wrong types
    ("lane_weights", ["a", "b", "c", "d"], r"lane_weights\[0\] = 'a' must be a finite number > 0"),
    ("lane_weights", None, r"lane_weights = None must be a list of numbers > 0"),
    ("notes", "hello", r"notes = 'hello' must be a list of strings, not str; write \['hello'\]"),
    ("task_graphs.1.modules", "blocks.1", r"task_graphs\[1\]\.modules = 'blocks\.1' must be a list of strings"),
    ("world_size", 8.0, r"world_size = 8\.0 must be an integer >= 1; write 8 "),
    ("num_micro_batch", 2.5, r"num_micro_batch = 2\.5 must be an integer >= 1"),
    ("num_replicas", "2", r"num_replicas = '2' must be an integer >= 1; write 2 "),
    ("num_replicas", True, r"num_replicas = True must be an integer"),
    ("task_graphs.1.index", 1.0, r"task_graphs\[1\]\.index = 1\.0 must be an integer >= 0"),
    ("task_graphs.0.index", False, r"task_graphs\[0\]\.index = False must be an integer"),
    ("task_graphs.0.device_count", True, r"task_graphs\[0\]\.device_count = True must be an integer >= 1"),
    ("task_graphs.1.nested.0.device_count", "2", r"task_graphs\[1\]\.nested\[0\]\.device_count = '2' must be an "
                                                 r"integer >= 1 or null"),
    ("task_graphs.0.num_params", -1, r"task_graphs\[0\]\.num_params = -1 must be an integer >= 0"),
    ("task_graphs", [5], r"task_graphs\[0\] = 5 must be a TaskGraph object"),
    ("task_graphs", "x", r"task_graphs = 'x' must be a list of TaskGraph objects"),
    ("shared_params", {"names": ["a"]}, r"shared_params = \{'names': \['a'\]\} must be a list of SharedParam"),
    ("stage_cuts.0.params", [None], r"stage_cuts\[0\]\.params\[0\] = None must be a string"),
    ("devices", [1] * 8, r"devices\[0\] = 1 must be a string"),
    ("device_order", ["7"] * 8, r"device_order\[0\] = '7' must be an integer >= 0"),
    ("device_order", [0] * 8, r"device_order = \[0, 0, .* must be a permutation of 0\.\.7"),
    ("colocated", "no", r"colocated = 'no' must be true or false"),
    ("task_graphs.1.nested.0.kind", 3, r"task_graphs\[1\]\.nested\[0\]\.kind 3 is unknown; choose one of"),
    ("schedule", "zigzag", r"schedule 'zigzag' is unknown; choose one of"),
    # non-finite and negative numbers
    ("lane_weights", [INF, 1, 1, 1], r"lane_weights\[0\] = inf must be a finite number > 0"),
    ("lane_weights", [1, 1, 0, 1], r"lane_weights\[2\] = 0 must be a finite number > 0"),
    ("task_graphs.1.nested.0.shard_weights", [NAN, 1.0], r"task_graphs\[1\]\.nested\[0\]\.shard_weights\[0\] = nan "
                                                         r"must be a finite number > 0"),
    ("task_graphs.0.shard_weights", [1.0, INF], r"task_graphs\[0\]\.shard_weights\[1\] = inf must be a finite"),
    ("predicted_utilization", [1.0] * 7 + [NAN], r"predicted_utilization\[7\] = nan must be a finite number >= 0"),
    ("predicted_utilization", [-0.5] + [1.0] * 7, r"predicted_utilization\[0\] = -0\.5 must be a finite number >= 0"),
    ("stage_flops", [INF, 1.0], r"stage_flops\[0\] = inf must be a finite number >= 0"),
    ("stage_flops", [1.0, NAN], r"stage_flops\[1\] = nan must be a finite number >= 0"),
    # shared parameters and stage cuts
    ("shared_params.0.stages", [0, 0], r"shared_params\[0\]\.stages = \[0, 0\] must list 2 or more different "
                                       r"stages; remove the repeats"),
    ("shared_params.0.stages", [1], r"shared_params\[0\]\.stages = \[1\] must list 2 or more different stages"),
    ("shared_params.0.stages", [0, 2], r"shared_params\[0\]\.stages = \[0, 2\] names a stage outside 0\.\.1"),
    ("shared_params.0.names", [], r"shared_params\[0\]\.names = \[\] must list 1 or more"),
    ("stage_cuts.1.nodes", ["blocks_1", "emb"], r"stage_cuts\[1\]\.nodes lists node 'emb', and so does "
                                                r"stage_cuts\[0\]\.nodes; stage cuts must be disjoint"),
    ("stage_cuts.0.nodes", [], r"stage_cuts\[0\]\.nodes = \[\] must list 1 or more"),
    # TaskGraph index and per-device lengths
    ("task_graphs.1.index", 0, r"task_graphs\[1\]\.index = 0 must equal its position 1 in task_graphs"),
    ("task_graphs.0.shard_weights", [1.0], r"task_graphs\[0\]\.shard_weights = \[1\.0\] must hold 2 positive"),
    ("lane_weights", [1.0], r"lane_weights = \[1\.0\] must hold 4 positive numbers"),
]


@pytest.mark.parametrize("path,value,match", BAD_PLAN_DATA, ids=[f"{p}={v!r}" for p, v, _ in BAD_PLAN_DATA])
def test_bad_plan_data_is_refused_naming_the_field_the_value_and_the_fix(path, value, match):
    data = _full_plan().to_dict()
    _edit(path, value)(data)
    with pytest.raises(PlanError, match=match) as from_dict:
        Plan.from_dict(data)
    with pytest.raises(PlanError, match=match):  # the same through JSON (Infinity and NaN included)
        Plan.from_json(json.dumps(data))
    assert "; " in str(from_dict.value)  # problem; fix


def test_edits_of_a_valid_plan_round_trip_exactly():
    data = _full_plan().to_dict()
    _edit("lane_weights", [1, 2, 3, 4])(data)  # ints are numbers; stored as floats
    _edit("task_graphs.1.nested.0.device_count", 2)(data)
    plan = Plan.from_dict(data)
    assert plan.lane_weights == (1.0, 2.0, 3.0, 4.0) and all(type(w) is float for w in plan.lane_weights)
    assert Plan.from_json(plan.to_json()) == plan and Plan.from_dict(plan.to_dict()) == plan


def test_bad_values_are_refused_on_construction_and_replace():
    with pytest.raises(PlanError, match=r"TaskGraph\.modules = 'blocks' must be a list of strings"):
        TaskGraph(0, "replicate", 2, "blocks")
    with pytest.raises(PlanError, match=r"SharedParam\.stages = \[0, 0\] must list 2 or more different stages"):
        SharedParam(("w",), (0, 0))
    with pytest.raises(PlanError, match=r"StageCut\.nodes = \[\] must list 1 or more"):
        StageCut(())
    with pytest.raises(PlanError, match=r"NestedScope\.device_count = 2\.0 must be an integer"):
        NestedScope("split", 2.0)
    plan = _full_plan()
    with pytest.raises(PlanError, match=r"lane_weights\[1\] = inf must be a finite number > 0"):
        dataclasses.replace(plan, lane_weights=(1.0, INF, 1.0, 1.0))
    with pytest.raises(PlanError, match=r"task_graphs\[0\]\.index = 1 must equal its position 0"):
        dataclasses.replace(plan, task_graphs=plan.task_graphs[::-1])
    with pytest.raises(PlanError, match=r"task_graphs\[1\]\.nested\[0\]\.shard_weights\[0\] = -1\.0 must be a finite"):
        dataclasses.replace(plan, task_graphs=[plan.task_graphs[0],
                                               {**dataclasses.asdict(plan.task_graphs[1]),
                                                "nested": [{"kind": "split", "device_count": None,
                                                            "shard_weights": [-1.0, 1.0]}]}])


@pytest.mark.parametrize("data,match", [
    ([], r"plan data = \[\] must be a Plan object"),
    ({"world_size": 1}, r"plan data lacks required fields \['task_graphs', 'num_replicas'\]"),
])
def test_plan_data_that_is_not_a_plan_object(data, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data)
