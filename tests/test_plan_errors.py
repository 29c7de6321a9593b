"""Planning errors say what is wrong and the fix that applies (no processes): the memory planner's advice when
nothing fits, a hand-edited plan moving a module between TaskGraphs, ``whale plan --args`` of the wrong type,
and a plan made for another world size."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import whale as wh
from tests.models import TinyLM
from tests.test_memory_options import _plan
from whale.cluster import ClusterSpec
from whale.config import Config
from whale.frontend.memplan import fit_memory
from whale.planner.balance import InfeasiblePlanError
from whale.planner.memory import MemoryOptions, StageMemory, choose_memory_options, plan_memory

_STAGE = [StageMemory(trainable_elements=10_000, activation_bytes=100.0, checkpointed_bytes=10.0,
                      backward_bytes=150.0, gather_elements=1000, recompute_flops=1e3, train_flops=1e6)]


def _choose(floor, forbid, device, host):
    plan = _plan(1, 2, 1)
    return choose_memory_options(lambda _o: plan, _STAGE, 4, floor, forbid, [device] * 2, [host] * 2, [1e12] * 2,
                                 1e12, ("T4", "P100-16GB"), 1)


def test_infeasible_advice_names_the_rank_the_bytes_and_only_the_fixes_that_apply():
    need = plan_memory(_plan(1, 2, 1), _STAGE, 4, MemoryOptions())[0].device_total
    with pytest.raises(InfeasiblePlanError) as e:
        _choose(MemoryOptions(), (), need * 0.03, 1e12)  # even every technique (ZeRO-3 + parameter offload:
        # the gathered 1000 elements' values and gradients) leaves the device short
    text = str(e.value)
    assert re.fullmatch(
        r"no allowed combination of memory techniques fits: even .+ leaves rank \d \((T4|P100-16GB)\) needing "
        r"[\d.]+ KiB of device memory, it has [\d.]+ KiB \(lacks [\d.]+ KiB\)\. Fixes: a device with more memory "
        r"for rank \d \(\w+(-16GB)?\) \(emulating: a larger memory_scale\); more devices or pipeline stages; "
        r"smaller micro-batches \(Config\(num_micro_batch=\.\.\.\) above 1, 4 rows per micro-batch now\) or a "
        r"smaller batch", text), text
    assert "forbid" not in text  # nothing is forbidden: relaxing it is no fix
    with pytest.raises(InfeasiblePlanError, match=r"; allow what Config\.forbid=\('zero', 'offload'\) keeps out "
                                                  r"\(ZeRO, offload\)$"):
        _choose(MemoryOptions(), ("zero", "offload"), need * 0.8, 1e12)


def test_a_short_host_is_told_to_add_host_memory_or_drop_the_offload_it_set():
    with pytest.raises(InfeasiblePlanError) as e:
        _choose(MemoryOptions(zero=1, offload="optimizer"), ("activation_checkpoint",), 1e9, 1e3)
    text = str(e.value)
    assert re.search(r"leaves rank \d \(\S+\) needing [\d.]+ KiB of host memory, it has 1000 B .*Fixes: more host "
                     r"memory for rank \d \(\S+\) \(host_memory_bytes of its node in the cluster spec\); no "
                     r"offload \(Config\(offload='none'\) instead of 'optimizer'\); more devices or pipeline stages",
                     text), text
    assert "smaller micro-batches" not in text and "more memory for rank" not in text


def test_a_placement_that_cannot_hold_one_row_says_so_through_the_planner():
    spec = ClusterSpec.from_dict({"nodes": [{"devices": [
        {"name": "Tiny", "fp32_flops": 1e12, "bf16_flops": 1e12, "memory_bytes": 2e3, "mem_bandwidth": 1e11}] * 2}]})
    with pytest.raises(InfeasiblePlanError, match=r"^no allowed combination of memory techniques fits: even with "
                       r".+, rank \d \(Tiny\) needs [\d.]+ KiB of device memory, has 2\.0 KiB, for its unsharded "
                       r"state and 1 row\(s\) of a micro-batch\. Fixes: a device with more memory for rank \d "
                       r"\(Tiny\)"):
        fit_memory(_plan(1, 2, 1), spec, _STAGE, 4, Config(), MemoryOptions(), lambda _w: True)


def test_a_plan_edited_to_move_a_module_between_task_graphs_is_refused():
    plan = wh.plan_model(TinyLM(stage_layers=(1, 1)), 2, wh.Config(num_micro_batch=2))
    assert wh.Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    data["task_graphs"][0]["modules"].remove("blocks.0")
    data["task_graphs"][1]["modules"].insert(0, "blocks.0")
    with pytest.raises(wh.PlanError, match=r"^task_graphs\[1\]\.modules lists 'blocks\.0' \(the plan says "
                       r"TaskGraph 1\), but the stage cut holds its tensors in stage 0, so it runs in TaskGraph 0; "
                       r"re-plan with wh\.plan_model \(or `whale plan --out`\) instead of editing"):
        wh.Plan.from_json(json.dumps(data))
    tg = dataclasses.replace(plan.task_graphs[0], modules=(*plan.task_graphs[0].modules, "head"))
    with pytest.raises(wh.PlanError, match=r"task_graphs\[0\]\.modules lists 'head' .* in stage 1, so it runs in "
                                         r"TaskGraph 1; re-plan"):
        dataclasses.replace(plan, task_graphs=(tg, plan.task_graphs[1]))


def test_whale_plan_args_of_the_wrong_type_or_name_give_one_line(capsys):
    from whale.cli import main

    base = ["plan", "--model", "examples.gpt.model:for_plan", "--world", "1", "--args"]
    assert main([*base, "n_layer=abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"whale plan: error: ValueError: --args n_layer=abc: n_layer takes an int "
                        r"\(e\.g\. n_layer=4\), got 'abc'", err), err
    assert main([*base, "n_layers=2"]) == 2
    assert re.search(r"--args n_layers=2: examples\.gpt\.model:for_plan takes no argument 'n_layers'; it takes "
                     r"n_layer, n_embd, ", capsys.readouterr().err)


def test_a_plan_for_another_world_size_names_whale_plan_world():
    from whale.runtime.parallelize import check_plan_fits

    plan = wh.plan_model(TinyLM(), 1, wh.Config())
    with pytest.raises(wh.PlanError, match=r"^the plan was made for world size 1 but this job has 2; make the "
                       r"plan with this job's settings \(whale plan --model MODULE:FACTORY --world 2 \.\.\. --out "
                       r"PLAN\.json\) or change them$"):
        check_plan_fits(plan, wh.Context(wh.Config(), 0, 2, torch.device("cpu"), None))
    with pytest.raises(wh.PlanError, match=r"--world 1 --micro-batches 2 --out"):
        check_plan_fits(plan, wh.Context(wh.Config(num_micro_batch=2), 0, 1, torch.device("cpu"), None))
