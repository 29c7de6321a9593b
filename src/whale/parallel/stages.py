"""This rank's pipeline stage, rebuilt from the plan's stage cut (which graph nodes the stage runs, by name).

The model is captured again (``torch.export`` from the plan's example inputs, or ``torch.fx``; with the plan's
``leaf_modules`` as single calls) and cut exactly where the plan
says; nothing is re-decided. Every rank checks the WHOLE cut against the model before any process group is
made (it holds the whole model), so a mismatch stops every rank with the same error instead of leaving some
waiting in a collective: the traced graph's nodes, each stage's parameters and buffers, the parameters tied
across stages, and the model's size. A model that does not match the plan (another model, another version of
its code, another width) is refused with the first difference named.
"""

from __future__ import annotations

from torch import fx, nn

from whale.frontend.graph import StageError, compute_nodes, tensor_names
from whale.frontend.stagecut import capture, stage_modules
from whale.parallel.chunks import Chunks
from whale.plan.plan import Plan

_REPLAN = "the plan was made for another model (or another version of its code): re-plan it"


def _check_size(model: nn.Module, plan: Plan) -> None:
    unique = {id(p): p for p in model.parameters()}
    numel = sum(p.numel() for p in unique.values())
    planned = sum(tg.num_params for tg in plan.task_graphs)
    if numel != planned:
        raise StageError(f"{type(model).__name__} has {numel:,} parameter elements but the plan's TaskGraphs hold "
                         f"{planned:,}; {_REPLAN}")


def _check_nodes(model: nn.Module, gm: fx.GraphModule, plan: Plan) -> dict[fx.Node, int]:
    owner: dict[str, int] = {}
    for s, cut in enumerate(plan.stage_cuts):
        for name in cut.nodes:
            if owner.setdefault(name, s) != s:
                raise StageError(f"node {name!r} is in the cuts of stages {owner[name]} and {s}; {_REPLAN}")
    nodes = compute_nodes(gm)
    names = {n.name for n in nodes}
    missing = [n.name for n in nodes if n.name not in owner]
    extra = [n for n in owner if n not in names]
    if missing or extra:
        raise StageError(
            f"{type(model).__name__}'s traced graph does not match the plan's stage cut: nodes "
            f"{(missing or extra)[:5]} are {'not in the plan' if missing else 'missing from the model'}; {_REPLAN}")
    return {n: owner[n.name] for n in nodes}


def _check_tensors(model: nn.Module, modules: list[fx.GraphModule], plan: Plan) -> None:
    for s, (module, cut) in enumerate(zip(modules, plan.stage_cuts, strict=True)):
        params, buffers = tensor_names(module)
        if set(params) != set(cut.params) or set(buffers) != set(cut.buffers):
            diff = sorted(set(params) ^ set(cut.params)) + sorted(set(buffers) ^ set(cut.buffers))
            raise StageError(f"stage {s} holds other tensors than the plan says (differs in {diff[:5]}); {_REPLAN}")
    tensor = dict(model.named_parameters(remove_duplicate=False))
    holders: dict[int, tuple[set[str], set[int]]] = {}
    for s, cut in enumerate(plan.stage_cuts):
        for name in cut.params:
            names, stages = holders.setdefault(id(tensor[name]), (set(), set()))
            names.add(name)
            stages.add(s)
    at = plan.position_of  # an interleaved cut's chunk c runs on stage at(c) (c % p unless chunk_positions says)
    tied = {(tuple(sorted(n)), tuple(sorted({at(c) for c in st}))) for n, st in holders.values()
            if len({at(c) for c in st}) > 1}
    planned = {(tuple(sorted(sp.names)), tuple(sorted(sp.stages))) for sp in plan.shared_params}
    if tied != planned:
        raise StageError(f"the model ties {sorted(tied) or 'no parameters'} across stages but the plan's "
                         f"shared_params say {sorted(planned) or 'none'}; a tie left out would let the copies "
                         f"drift apart; {_REPLAN}")


def build_stage(model: nn.Module, plan: Plan, stage: int, prebuilt: tuple = ()) -> nn.Module:
    """The module running ``stage`` of ``plan``: ``model`` itself without a pipeline, else a ``GraphModule``
    that shares ``model``'s parameters and keeps their original names. Checks the whole plan against the model
    first (see the module docstring); no communication.

    ``prebuilt``: the stage modules the front end made for ``plan`` in this process (nothing is re-captured).

    Raises:
        StageError: a pipeline plan without a stage cut, or a model whose size, traced graph, parameters,
            buffers or tied parameters differ from the plan's (naming the first difference).
    """
    if not plan.is_pipeline:
        _check_size(model, plan)
        return model
    if not plan.stage_cuts:
        raise StageError(f"the plan has {plan.num_stages} pipeline stages but no stage cut; make it with "
                         "whale.plan_model (or `whale plan --out`), which records the cut")
    if prebuilt:  # cut for this very plan by the front end in this process: checked by construction
        _check_size(model, plan)
        return _rank_module(list(prebuilt), plan, stage)
    cap = capture(model, plan.leaf_modules, plan.capture_inputs if plan.capture == "export" else ())
    stages = _check_nodes(model, cap.train, plan)
    home = {n: s for s, cut in enumerate(plan.stage_cuts) for n in (*cut.params, *cut.buffers)}
    modules = stage_modules(model, cap, stages, plan.num_chunks, home)
    _check_tensors(model, modules, plan)
    _check_size(model, plan)
    return _rank_module(modules, plan, stage)


def _rank_module(modules: list[nn.Module], plan: Plan, stage: int) -> nn.Module:
    """Stage ``stage``'s module: the cut's module, or under an interleaved plan its chunks (``stage, stage + p,
    ...``, or those ``chunk_positions`` puts on it) as one :class:`~whale.parallel.chunks.Chunks`."""
    if plan.virtual_stages == 1:
        return modules[stage]
    if plan.capture == "export":
        raise StageError(f"virtual_stages={plan.virtual_stages} runs torch.fx chunks, but the plan was captured "
                         "with torch.export; re-plan it with Config(capture='fx')")
    return Chunks([modules[c] for c in plan.chunks_of(stage)])
