"""Hardware-aware analysis: profile the model on fake tensors and cut the pipeline by device speed and memory
(the Whale paper's §3.3); :mod:`whale.frontend.memplan` turns the profile into each stage's memory.

Everything here is analysis before any process group is touched; the arithmetic lives in the pure functions
of :mod:`whale.plan.partition`, :mod:`whale.plan.balance` and :mod:`whale.plan.hardware`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from whale.cluster import ClusterSpec, memory_capacity
from whale.config import Config
from whale.frontend.profile import ModelProfile, profile_model
from whale.plan.balance import InfeasiblePlanError
from whale.plan.hardware import apply_hardware
from whale.plan.partition import partition_layers
from whale.plan.plan import Plan, StageCut
from whale.plan.schedule import in_flight_micro_batches


@dataclass(frozen=True)
class UnitCut:
    """Pipeline cut chosen by speed and memory: ``stage_of`` (tensor FQN -> stage) and the unit names per
    stage."""

    stage_of: dict[str, int]
    units: list[list[str]]


def sample_rows(sample_batch) -> int:
    """Global batch size of a sample batch ``(inputs, target)`` (the target's rows; inputs may be a dict of
    keyword arguments with non-tensor values)."""
    target = sample_batch[1]
    if isinstance(target, torch.Tensor):
        return int(target.size(0))
    inputs = sample_batch[0]
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, tuple | list) else [inputs]
    return int(next(v for v in values if isinstance(v, torch.Tensor)).size(0))


def profile(model: nn.Module, sample_batch, rows: int = 2, loss_fn=None) -> ModelProfile:
    """Per-unit FLOPs and bytes of one training step on ``rows`` samples of ``sample_batch`` (fake tensors),
    with the training loss ``loss_fn(output, target)`` when given (its saved tensors and backward temporaries,
    e.g. a language model's log-probabilities and logit gradients, count in ``rest``)."""
    inputs, target = sample_batch[0], sample_batch[1]
    b = max(1, min(rows, sample_rows(sample_batch)))

    def make(b: int):
        # clone: a slice keeps the whole batch's storage, which the profiler would count as activations
        """The sample inputs cut to ``b`` rows."""
        cut = lambda t: t[:b].clone() if isinstance(t, torch.Tensor) and t.dim() else t  # noqa: E731
        if isinstance(inputs, dict):
            return {k: cut(v) for k, v in inputs.items()}
        if isinstance(inputs, tuple | list):
            return tuple(cut(t) for t in inputs)
        return cut(inputs)

    loss = None
    if loss_fn is not None and isinstance(target, torch.Tensor):
        loss = lambda out, *_a: loss_fn(out, target[:b].clone())  # noqa: E731
    return profile_model(model, make, batch_size=b, loss_fn=loss)


def _stage_speeds(layout: Plan, cluster: ClusterSpec, dtype: str = "fp32") -> tuple[list[float], list[float]]:
    """Per stage, the speed of one of its devices (the slowest) times its lanes over the narrowest stage's
    lanes (a stage twice as wide takes each micro-batch's rows twice as fast), and the least memory."""
    devs = cluster.devices()
    speeds, caps = [], []
    fewest = min(layout.lanes_of(s) for s in range(layout.num_stages))
    for s in range(layout.num_stages):
        ranks = layout.stage_ranks(s)
        speeds.append(min(devs[r].flops(dtype) for r in ranks) * layout.lanes_of(s) / fewest)
        caps.append(min(memory_capacity(cluster, r) for r in ranks))
    return speeds, caps


def hardware_cut(model: nn.Module, prof: ModelProfile, layout: Plan, cluster: ClusterSpec, config: Config,
                 global_batch: int) -> UnitCut:
    """Contiguous unit cut minimizing the slowest stage within memory, on the devices ``layout`` (a plan with
    the device order already applied) gives each stage. Stages of different widths are compared by rows per
    device of the narrowest stage (activation bytes are counted at that many rows on every stage: an upper
    bound for the wider ones).

    When no cut fits the devices' memory without memory techniques, the cut minimizes the slowest stage alone
    and :mod:`whale.plan.memory` then adds checkpointing, ZeRO or offload (or says nothing fits).
    """
    layout = apply_hardware(layout, cluster)
    speeds, caps = _stage_speeds(layout, cluster)
    units = list(prof.units)
    mb_rows = global_batch / config.num_micro_batch / min(layout.lanes_of(s) for s in range(layout.num_stages))
    flops = [u.train_flops * mb_rows for u in units]
    flops[-1] += prof.rest.train_flops * mb_rows
    static = [float(u.static_bytes) for u in units]
    act = [u.activation_bytes * mb_rows for u in units]
    s_count, m = layout.num_stages, config.num_micro_batch
    in_flight = [in_flight_micro_batches(s, s_count, m, config.schedule) for s in range(s_count)]
    try:
        counts = partition_layers(flops, static, speeds, caps, act, in_flight)
    except InfeasiblePlanError:  # no cut fits as is: cut by speed; the memory planner adds what makes it fit
        counts = partition_layers(flops, static, speeds, [float("inf")] * len(caps), act, in_flight)
    stage_of: dict[str, int] = {}
    names: list[list[str]] = []
    start = 0
    for s, c in enumerate(counts):
        names.append([u.name for u in units[start:start + c]])
        for u in units[start:start + c]:
            mod = model.get_submodule(u.name)
            for name, _ in [*mod.named_parameters(prefix=u.name, remove_duplicate=False),
                            *mod.named_buffers(prefix=u.name, remove_duplicate=False)]:
                stage_of.setdefault(name, s)
        start += c
    return UnitCut(stage_of, names)


def _unit_stages(prof: ModelProfile, stage_params: list[set[str]]) -> list[int]:
    """Stage of each profiled unit: the first stage holding one of its parameters (the last stage otherwise)."""
    out = []
    for u in prof.units:
        prefix = u.name + "."
        out.append(next((s for s, names in enumerate(stage_params)
                         if any(n == u.name or n.startswith(prefix) for n in names)), len(stage_params) - 1))
    return out


def stage_param_names(cuts: tuple[StageCut, ...], model: nn.Module) -> list[set[str]]:
    """Parameter FQNs per stage: from the plan's stage cuts, or every parameter of ``model`` for one stage."""
    if cuts:
        return [set(c.params) for c in cuts]
    return [{n for n, _ in model.named_parameters(remove_duplicate=False)}]


def stage_flops(prof: ModelProfile, stage_params: list[set[str]]) -> tuple[float, ...]:
    """Training FLOPs per sample of each stage (units by the stage holding their parameters; the rest last)."""
    out = [0.0] * len(stage_params)
    for u, stage in zip(prof.units, _unit_stages(prof, stage_params), strict=True):
        out[stage] += u.train_flops
    out[-1] += prof.rest.train_flops
    return tuple(out)
