"""Annotations -> TaskGraphs -> plan, and the errors for input that has no meaning (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import whale as wh
from tests.models import TinyLM
from whale.annotation import tensor_scopes
from whale.plan.plan import NestedScope


def test_scopes_tag_parameters_and_tied_weights_keep_the_first_tag():
    model = TinyLM(stage_layers=(1, 2))
    scopes = tensor_scopes(model)
    assert "emb.weight" not in scopes and "head.weight" not in scopes  # built outside any scope
    assert scopes["blocks.0.fc1.weight"].uid != scopes["blocks.1.fc1.weight"].uid
    assert scopes["blocks.1.fc1.weight"].uid == scopes["blocks.2.ln.bias"].uid


def test_plan_of_a_pipeline_lists_modules_per_stage_and_tied_weights():
    plan = wh.plan_model(TinyLM(stage_layers=(1, 2)), world_size=4, config=wh.Config(num_micro_batch=2))
    assert plan.num_stages == 2 and plan.num_replicas == 2
    assert plan.task_graphs[0].modules == ("pos", "emb", "blocks.0")
    assert plan.task_graphs[1].modules == ("blocks.1", "blocks.2", "ln", "head")
    assert [(sp.names, sp.stages) for sp in plan.shared_params] == [(("emb.weight", "head.weight"), (0, 1))]


def test_no_annotation_means_replicate_over_all_devices():
    plan = wh.plan_model(TinyLM(), world_size=3)
    assert [(tg.kind, tg.device_count) for tg in plan.task_graphs] == [("replicate", 3)]
    assert plan.num_replicas == 1 and plan.num_lanes == 3


def test_default_strategy_sets_the_device_count():
    wh.set_default_strategy(wh.replicate(2))
    try:
        plan = wh.plan_model(TinyLM(), world_size=4)
    finally:
        wh.set_default_strategy(None)
    assert plan.task_graphs[0].device_count == 2 and plan.num_replicas == 2


@pytest.mark.parametrize("outer,inner", [(wh.replicate, wh.replicate), (wh.split, wh.split), (wh.split, wh.replicate)])
def test_nesting_without_meaning_names_both_scopes(outer, inner):
    with pytest.raises(wh.AnnotationError, match=rf"{inner.__name__}\(2\).* is nested inside {outer.__name__}\(all\)"):
        with outer():
            with inner(2):
                pass
    # the failed nesting left no scope open
    assert not tensor_scopes(nn.Linear(2, 2))


def test_split_inside_replicate_is_recorded_as_nested():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            with wh.replicate():
                self.body = nn.Linear(4, 4)
                with wh.split(2):
                    self.head = nn.Linear(4, 8)

        def forward(self, x):
            return self.head(self.body(x))

    plan = wh.plan_model(M(), world_size=2)
    nested = plan.task_graphs[0].nested
    assert nested == (NestedScope("split", 2, ("head",)),)
    assert "nested split(2): head" in str(plan)


def test_split_over_one_device_is_the_module_itself():
    with wh.split(1):
        model = nn.Linear(4, 4)
    assert wh.plan_model(model, 1).task_graphs[0].kind == "split"
    ctx = wh.init(wh.Config())
    engine = wh.parallelize(model, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    assert engine.split.regions == [] and engine.module is model
    x = torch.randn(4, 4)
    assert engine.step((x, x))["loss"] > 0


def test_annotate_maps_patterns_onto_an_unedited_model():
    model = TinyLM(stage_layers=(3,))
    wh.annotate(model, {"blocks.0": wh.replicate(1), "blocks.[12]": wh.replicate(1)})
    plan = wh.plan_model(model, world_size=2, config=wh.Config(num_micro_batch=2))
    assert plan.task_graphs[0].modules == ("pos", "emb", "blocks.0")
    assert plan.task_graphs[1].modules == ("blocks.1", "blocks.2", "ln", "head")


def test_annotate_pattern_that_matches_nothing():
    with pytest.raises(wh.AnnotationError, match="matches no module"):
        wh.annotate(TinyLM(), {"decoder.*": wh.replicate()})


def test_bad_device_count():
    with pytest.raises(wh.AnnotationError, match="device_count must be an int >= 1"):
        wh.replicate(0)


def test_model_with_no_parameters():
    with pytest.raises(ValueError, match="has no parameters"):
        wh.plan_model(nn.ReLU(), world_size=1)


class _TwoStages(nn.Module):
    """Two replicate(1) TaskGraphs ``a`` and ``b``; subclasses give the forward."""

    def __init__(self):
        super().__init__()
        with wh.replicate(1):
            self.a = nn.Linear(2, 2)
        with wh.replicate(1):
            self.b = nn.Linear(2, 2)


def test_untraceable_pipeline_gives_the_fix():
    class Branchy(_TwoStages):
        def forward(self, x):
            if x.sum() > 0:
                return self.b(self.a(x))
            return self.a(x)

    with pytest.raises(wh.StageError, match="symbolic_trace"):
        wh.plan_model(Branchy(), world_size=2)


def test_stage_with_no_work_is_reported():
    class Unused(_TwoStages):
        def forward(self, x):
            return self.a(x)

    with pytest.raises(wh.StageError, match="stage 1 of 2 has no operations"):
        wh.plan_model(Unused(), world_size=2)
