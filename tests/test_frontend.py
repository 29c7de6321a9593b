"""The front end and the plan contract: planning imports no runtime, plan/ imports nothing above it, and a plan
written by ``whale plan --out`` drives training exactly like a plan made in process."""

from __future__ import annotations

import ast
import copy
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, lm_loss, reference_step, tied_pipe_with_split
from whale.frontend.graph import StageError
from whale.parallel.stages import build_stage

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN_ARGS = ["plan", "--model", "tests.models:tied_pipe_with_split", "--world", "4", "--micro-batches", "2"]


def test_planning_imports_neither_runtime_nor_parallel():
    code = (
        "import sys, whale as wh, whale.cli\n"
        "from tests.models import TinyLM\n"
        "print(wh.plan_model(TinyLM(stage_layers=(1, 1)), 2, wh.Config(num_micro_batch=2)))\n"
        f"rc = whale.cli.main({PLAN_ARGS!r})\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith(('whale.runtime', 'whale.parallel'))))\n"
        "sys.exit(rc)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout and "schedule (per stage)" in out.stdout


def test_plan_package_imports_nothing_above_it():
    for path in (ROOT / "src" / "whale" / "plan").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("whale.frontend", "whale.parallel", "whale.runtime")), (path, name)


def test_a_plan_for_another_model_is_refused_by_name():
    plan = wh.plan_model(TinyLM(stage_layers=(1, 1)), 2, wh.Config(num_micro_batch=2))
    with pytest.raises(StageError, match="does not match the plan's stage cut.*re-plan"):
        build_stage(TinyLM(stage_layers=(1, 2)), plan, 0)
    cut = plan.stage_cuts[0]
    edited = dataclasses.replace(plan, stage_cuts=(dataclasses.replace(cut, params=cut.params[1:]),
                                                   *plan.stage_cuts[1:]))
    with pytest.raises(StageError, match="stage 0 holds other tensors than the plan says"):
        build_stage(TinyLM(stage_layers=(1, 1)), edited, 0)


def test_the_runtime_follows_the_plan_not_the_annotations():
    shifted = wh.plan_model(TinyLM(stage_layers=(2, 1)), 2, wh.Config(num_micro_batch=2))
    stage0 = build_stage(TinyLM(stage_layers=(1, 2)), shifted, 0)  # annotated 1 + 2, planned 2 + 1
    names = {n for n, _ in stage0.named_parameters()}
    assert {"blocks.0.fc1.weight", "blocks.1.fc1.weight"} <= names and "blocks.2.fc1.weight" not in names


def _train(rank, world, plan_text):
    ctx = wh.init(wh.Config(num_micro_batch=2))
    data = [(x[:, :6] % 16, y[:, :6] % 16) for x, y in lm_batches(3, 8)]
    losses = {}
    for name in ("json", "in_process", "reference"):
        model = tied_pipe_with_split(seed=1)
        if name == "reference":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses[name] = []
            for x, y in data:
                opt.zero_grad()
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                losses[name].append(loss.item())
            continue
        plan = wh.Plan.from_json(plan_text) if name == "json" else None
        engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx, plan=plan)
        losses[name] = [engine.step(b)["loss"] for b in data]
        losses[name + "_plan"] = engine.plan.to_json()
        losses[name + "_regions"] = len(engine.split.regions)
    return losses


def test_a_plan_written_by_whale_plan_trains_like_the_in_process_plan(tmp_path, capsys):
    from whale.cli import main

    path = tmp_path / "plan.json"
    assert main([*PLAN_ARGS, "--out", str(path)]) == 0
    assert f"plan written to {path}" in capsys.readouterr().out
    plan = wh.Plan.from_json(path.read_text())
    assert plan.num_stages == 2 and plan.stage_width == 2 and plan.num_lanes == 2
    assert [sp.names for sp in plan.shared_params] == [("emb.weight", "head.weight")]
    assert plan.task_graphs[1].nested[0].modules == ("mlp",) and plan.leaf_modules == ("mlp",)
    results = run_ranks(_train, 4, path.read_text())
    for r in results:
        assert r["json"] == r["in_process"]  # bit for bit: the same plan, nothing re-planned
        assert wh.Plan.from_json(r["json_plan"]) == wh.Plan.from_json(r["in_process_plan"]) == plan
        assert r["json"] == pytest.approx(r["reference"], rel=1e-5, abs=1e-6)
    assert [r["json_regions"] for r in results] == [0, 0, 1, 1]


def test_a_plan_that_unties_tied_weights_or_fits_another_width_is_refused():
    plan = wh.plan_model(TinyLM(stage_layers=(1, 1)), 2, wh.Config(num_micro_batch=2))
    with pytest.raises(StageError, match="ties .*emb.weight.* shared_params say none"):
        build_stage(TinyLM(stage_layers=(1, 1)), dataclasses.replace(plan, shared_params=()), 1)
    with pytest.raises(StageError, match="parameter elements but the plan's TaskGraphs hold"):
        build_stage(TinyLM(stage_layers=(1, 1), d=32), plan, 0)


def test_a_given_plan_must_agree_with_the_job():
    from whale.cluster import ClusterSpec
    from whale.runtime.parallelize import check_plan_fits

    spec = ClusterSpec.from_dict({"nodes": [{"devices": ["V100-32GB"]}]})
    plan = wh.plan_model(TinyLM(), 1, wh.Config(num_micro_batch=2, cluster=spec))
    ok = wh.Context(wh.Config(num_micro_batch=2), 0, 1, torch.device("cpu"), spec)
    check_plan_fits(plan, ok)
    with pytest.raises(wh.PlanError, match="made for num_micro_batch 2 but this job has 1"):
        check_plan_fits(plan, wh.Context(wh.Config(), 0, 1, torch.device("cpu"), spec))
    with pytest.raises(wh.PlanError, match=r"made for devices \['V100-32GB'\] but this job runs on no cluster"):
        check_plan_fits(plan, wh.Context(wh.Config(num_micro_batch=2), 0, 1, torch.device("cpu"), None))


def _tie_in_last_scope(rank, world):
    from tests.models import HeadScopedTie

    ctx = wh.init(wh.Config(num_micro_batch=2))
    model = HeadScopedTie()
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for x, y in lm_batches(3, 8):
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(reference_step(ref_opt, lm_loss(ref(x), y)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    return sorted(n for n, _ in engine.module.named_parameters(remove_duplicate=False))


def test_a_tie_into_the_last_stage_does_not_drag_annotated_modules():
    from tests.models import HeadScopedTie

    plan = wh.plan_model(HeadScopedTie(), 2, wh.Config(num_micro_batch=2))
    assert {"emb.weight", "block0.fc1.weight"} <= set(plan.stage_cuts[0].params)
    assert "block0.fc1.weight" not in plan.stage_cuts[1].params
    assert [(sp.names, sp.stages) for sp in plan.shared_params] == [(("emb.weight", "head.weight"), (0, 1))]
    stage0, stage1 = run_ranks(_tie_in_last_scope, 2)
    assert "block0.fc1.weight" in stage0 and "block1.fc1.weight" in stage1 and "head.weight" in stage1


def test_an_annotated_stage_left_empty_says_why():
    class Reversed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with wh.replicate(1):
                self.first = torch.nn.Linear(4, 4)
            with wh.replicate(1):
                self.second = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.first(self.second(x))  # the stage-1 module runs first

    with pytest.raises(StageError, match=r"stage 0 of 2 has no operations .*'first' runs in stage 1 because its "
                                         r"input 'second' comes from stage 1"):
        wh.plan_model(Reversed(), 2, wh.Config(num_micro_batch=2))
