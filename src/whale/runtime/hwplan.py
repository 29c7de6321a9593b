"""Hardware-aware analysis: profile the model on fake tensors, cut the pipeline by device speed and memory,
and build the memory model for the intra-TaskGraph balancer (DESIGN.md §5, §7).

Everything here is analysis before any process group is touched; the arithmetic lives in the pure functions
of :mod:`whale.plan.partition`, :mod:`whale.plan.balance` and :mod:`whale.plan.hardware`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from whale.cluster import ClusterSpec, memory_capacity
from whale.config import Config
from whale.plan.hardware import MemoryModel, apply_hardware
from whale.plan.partition import partition_layers
from whale.plan.plan import Plan
from whale.profile import ModelProfile, profile_model


@dataclass
class Cut:
    """Pipeline cut chosen by the planner: ``stage_of`` (id(tensor) -> stage) and the unit names per stage."""

    stage_of: dict[int, int]
    stage_layers: list[list[str]]


def sample_rows(sample_batch) -> int:
    """Global batch size of a sample batch ``(inputs, target)``."""
    inputs = sample_batch[0]
    first = inputs[0] if isinstance(inputs, tuple | list) else inputs
    return int(first.size(0))


def profile(model: nn.Module, sample_batch, rows: int = 2) -> ModelProfile:
    """Per-unit FLOPs and bytes of one training step on ``rows`` samples of ``sample_batch`` (fake tensors)."""
    inputs = sample_batch[0]

    def make(b: int):
        # clone: a slice keeps the whole batch's storage, which the profiler would count as activations
        """The sample inputs cut to ``b`` rows."""
        if isinstance(inputs, tuple | list):
            return tuple(t[:b].clone() for t in inputs)
        return inputs[:b].clone()

    return profile_model(model, make, batch_size=max(1, min(rows, sample_rows(sample_batch))))


def _stage_speeds(layout: Plan, cluster: ClusterSpec, dtype: str = "fp32") -> tuple[list[float], list[float]]:
    devs = cluster.devices()
    speeds, caps = [], []
    for s in range(layout.num_stages):
        ranks = layout.stage_ranks(s)
        speeds.append(min(devs[r].flops(dtype) for r in ranks))
        caps.append(min(memory_capacity(cluster, r) for r in ranks))
    return speeds, caps


def hardware_cut(model: nn.Module, prof: ModelProfile, layout: Plan, cluster: ClusterSpec, config: Config,
                 global_batch: int) -> Cut:
    """Contiguous unit cut minimizing the slowest stage within memory, on the devices ``layout`` (a plan with
    the device order already applied) gives each stage.

    Raises:
        InfeasiblePlanError: no contiguous cut fits the stages' memory.
    """
    layout = apply_hardware(layout, cluster)
    speeds, caps = _stage_speeds(layout, cluster)
    units = list(prof.units)
    mb_rows = global_batch / config.num_micro_batch / layout.num_lanes
    flops = [u.train_flops * mb_rows for u in units]
    flops[-1] += prof.rest.train_flops * mb_rows
    static = [float(u.static_bytes) for u in units]
    act = [u.activation_bytes * mb_rows for u in units]
    s_count, m = layout.num_stages, config.num_micro_batch
    in_flight = [m if config.schedule == "GPipe" else min(m, s_count - s) for s in range(s_count)]
    counts = partition_layers(flops, static, speeds, caps, act, in_flight)
    stage_of: dict[int, int] = {}
    names: list[list[str]] = []
    start = 0
    for s, c in enumerate(counts):
        names.append([u.name for u in units[start:start + c]])
        for u in units[start:start + c]:
            mod = model.get_submodule(u.name)
            for t in list(mod.parameters()) + list(mod.buffers()):
                stage_of.setdefault(id(t), s)
        start += c
    return Cut(stage_of, names)


def memory_model(prof: ModelProfile, stage_modules: list[nn.Module], global_batch: int) -> MemoryModel:
    """Fixed and per-sample bytes per stage: a unit counts in the stage that holds its first tensor; work
    outside every unit counts in the last stage."""
    holders = [{id(t) for t in list(m.parameters()) + list(m.buffers())} for m in stage_modules]
    fixed = [0.0] * len(stage_modules)
    per = [0.0] * len(stage_modules)
    for u in prof.units:
        stage = next((s for s, ids in enumerate(holders) if _holds(ids, u.name, stage_modules[s])),
                     len(stage_modules) - 1)
        fixed[stage] += u.static_bytes
        per[stage] += u.activation_bytes
    fixed[-1] += prof.rest.static_bytes
    per[-1] += prof.rest.activation_bytes
    return MemoryModel(global_batch, fixed, per)


def stage_flops(prof: ModelProfile, stage_modules: list[nn.Module]) -> list[float]:
    """Training FLOPs per sample of each stage (units by the stage holding their parameters; the rest last)."""
    holders = [{id(t) for t in list(m.parameters()) + list(m.buffers())} for m in stage_modules]
    out = [0.0] * len(stage_modules)
    for u in prof.units:
        stage = next((s for s, ids in enumerate(holders) if _holds(ids, u.name, stage_modules[s])),
                     len(stage_modules) - 1)
        out[stage] += u.train_flops
    out[-1] += prof.rest.train_flops
    return out


def _holds(ids: set[int], unit: str, module: nn.Module) -> bool:
    try:
        sub = module.get_submodule(unit)
    except AttributeError:
        return False
    return any(id(p) in ids for p in sub.parameters())
