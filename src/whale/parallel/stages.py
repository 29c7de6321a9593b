"""This rank's pipeline stage, rebuilt from the plan's stage cut (which graph nodes the stage runs, by name).

The model is traced again (with the plan's ``leaf_modules`` as single calls) and cut exactly where the plan
says; nothing is re-decided. A model whose trace does not match the plan (another model, another version of
its code) is refused with the first difference named.
"""

from __future__ import annotations

from torch import nn

from whale.frontend.graph import StageError, compute_nodes, stage_module, tensor_names, trace
from whale.plan.plan import Plan


def build_stage(model: nn.Module, plan: Plan, stage: int) -> nn.Module:
    """The module running ``stage`` of ``plan``: ``model`` itself without a pipeline, else a ``GraphModule``
    that shares ``model``'s parameters and keeps their original names.

    Raises:
        StageError: a pipeline plan without a stage cut, or a model whose traced graph, parameters or buffers
            differ from the plan's (naming the first difference).
    """
    if not plan.is_pipeline:
        return model
    if not plan.stage_cuts:
        raise StageError(f"the plan has {plan.num_stages} pipeline stages but no stage cut; make it with "
                         "whale.plan_model (or `whale plan --out`), which records the cut")
    gm = trace(model, plan.leaf_modules)
    owner = {name: s for s, cut in enumerate(plan.stage_cuts) for name in cut.nodes}
    nodes = compute_nodes(gm)
    names = {n.name for n in nodes}
    missing = [n.name for n in nodes if n.name not in owner]
    extra = [n for n in owner if n not in names]
    if missing or extra:
        raise StageError(
            f"{type(model).__name__}'s traced graph does not match the plan's stage cut: nodes "
            f"{(missing or extra)[:5]} are {'not in the plan' if missing else 'missing from the model'}; the plan "
            "was made for another model (or another version of its code): re-plan it")
    module = stage_module(gm, {n: owner[n.name] for n in nodes}, plan.num_stages, stage)
    params, buffers = tensor_names(module)
    cut = plan.stage_cuts[stage]
    if set(params) != set(cut.params) or set(buffers) != set(cut.buffers):
        diff = sorted(set(params) ^ set(cut.params)) + sorted(set(buffers) ^ set(cut.buffers))
        raise StageError(f"stage {stage} holds other tensors than the plan says (differs in {diff[:5]}); the plan "
                         "was made for another model: re-plan it")
    return module
