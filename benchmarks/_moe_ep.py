"""Rank workers of :mod:`benchmarks.moe` beyond the all-to-all bytes: gradient-sync bytes of expert parallelism vs
plain data parallelism, parameter bytes per rank vs the expert count, and uniform vs hardware-aware expert counts
on an EMULATED V100 + P100 cluster.

The model (:class:`MoEStack`) is a stack of residual MoE layers with a tiny dense part (one ``Linear`` in and one
out), built in a ``wh.replicate()`` with each MoE layer under a nested ``wh.split()`` (expert parallelism over
all ranks) or, for the data-parallel baseline, without the split (every expert replicated on every rank).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import whale as wh
from benchmarks._hetero_common import emulation_setup, load_spec
from whale.runtime.emulation import emulation_slowdown

EXPERT_PARAMS = ("w1", "b1", "w2", "b2")


class MoEStack(nn.Module):
    """``[B, T, d] -> [B, T, d]``: ``x + moe_l(x)`` for ``layers`` MoE layers between two ``Linear(d, d)``;
    ``parallel``: each MoE under a split nested in the replicate (expert parallel), else replicated (plain
    data parallelism); ``dense_io=False`` drops the input ``Linear`` (the tagged routing below needs the
    inputs' tags untouched)."""

    def __init__(self, d: int, d_ff: int, experts: int, layers: int, top_k: int = 2, parallel: bool = True,
                 dense_io: bool = True) -> None:
        super().__init__()
        with wh.replicate():
            self.inp = nn.Linear(d, d) if dense_io else nn.Identity()
            moes = []
            for _ in range(layers):
                with wh.split() if parallel else contextlib.nullcontext():
                    moes.append(wh.MoE(d, d_ff, experts, top_k, None, aux_loss_coef=0.01))
            self.moes = nn.ModuleList(moes)
            self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for moe in self.moes:
            h = h + moe(h)
        return self.out(h)


def expert_numel(model: nn.Module) -> int:
    """Elements of the experts' stacked tensors (``w1, b1, w2, b2`` of every MoE layer or shard) of ``model``."""
    return sum(getattr(m, n).numel() for m in model.modules() if getattr(m, "is_moe", False)
               for n in EXPERT_PARAMS if getattr(m, n, None) is not None)


def _param_bytes(module: nn.Module) -> tuple[int, int]:
    """``(expert bytes, other bytes)`` of the parameters this rank holds (each tensor once)."""
    expert = sum(getattr(m, n).numel() * getattr(m, n).element_size() for m in module.modules()
                 if getattr(m, "is_moe", False) for n in EXPERT_PARAMS if getattr(m, n, None) is not None)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    return expert, total - expert


def _loss(model):
    return lambda out, y: F.mse_loss(out, y) + wh.moe_aux_loss(model)


def grad_sync_and_memory(rank: int, world: int, cfg: dict) -> dict:
    """Gradient-sync bytes per rank of one step, expert parallel vs data parallel (the same model and batch),
    and this rank's parameter bytes (experts, rest) at each expert count of ``cfg["memory_experts"]``."""
    ctx = wh.init(wh.Config(seed=0))
    d, f, layers = cfg["d"], cfg["d_ff"], cfg["layers"]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(cfg["batch"], cfg["tokens"], d, generator=g), torch.randn(cfg["batch"], cfg["tokens"], d,
                                                                                 generator=g)
    out = {"sync": {}, "memory": {}}
    for name, parallel in (("expert_parallel", True), ("data_parallel", False)):
        model = MoEStack(d, f, cfg["experts"], layers, parallel=parallel)
        numel = sum(p.numel() for p in model.parameters())
        engine = wh.parallelize(model, _loss(model), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
        sync = [engine.step((x, y))["sync_bytes"] for _ in range(cfg["sync_steps"])]
        out["sync"][name] = {"bytes_per_step": sync, "model_numel": numel, "expert_numel": expert_numel(model),
                             "held_bytes": _param_bytes(engine.module)}
    for e in cfg["memory_experts"]:
        model = MoEStack(d, f, e, layers)
        engine = wh.parallelize(model, _loss(model), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
        sizes = [m.sizes for m in engine.module.modules() if type(m).__name__ == "ExpertParallelMoE"][0]
        out["memory"][e] = {"bytes": _param_bytes(engine.module), "counts": sizes,
                            "per_expert_bytes": layers * 4 * (2 * d * f + f + d)}
    return out


def tag_router(model: MoEStack, experts: int, scale: float = 10.0) -> None:
    """Balanced top-1 routing for the timing case: each MoE's router reads only the first E input dims (a
    token's one-hot tag, :func:`tagged_batch`), and every expert's output is 0 there (``w2``, ``b2`` columns
    zeroed), so the tags pass through the residual stream unchanged and every layer sends token i to expert
    ``i mod E``: an even load per expert (train with lr 0 so that it stays so)."""
    with torch.no_grad():
        for m in model.moes:
            m.router.weight.zero_()
            m.router.weight[:, :experts] = scale * torch.eye(experts)
            m.w2[:, :, :experts] = 0.0
            m.b2[:, :experts] = 0.0


def tagged_batch(batch: int, tokens: int, d: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [batch, tokens, d]``: random content with token t of each sample tagged one-hot at dim ``t mod E``
    of the first E dims (zero elsewhere there); ``y`` random."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, tokens, d, generator=g)
    x[..., :experts] = F.one_hot(torch.arange(tokens) % experts, experts).float()
    return x, torch.randn(batch, tokens, d, generator=g)


def _hetero_engines(ctx, cfg: dict, world: int) -> dict:
    """Uniform and hardware-aware expert counts of the same tagged model: the plan's default on the cluster
    (hardware-aware split weights and batch shares), and the same plan with equal split weights."""
    from tests.moe_models import with_shard_weights

    engines = {}
    for name in ("uniform", "hardware-aware"):
        model = MoEStack(cfg["d"], cfg["d_ff"], cfg["experts"], cfg["layers"], top_k=1, dense_io=False)
        tag_router(model, cfg["experts"])
        plan = wh.plan_model(model, world, ctx.config)
        if name == "uniform":
            plan = with_shard_weights(plan, [1.0] * world)
        engines[name] = wh.parallelize(model, _loss(model), lambda ps: torch.optim.SGD(ps, lr=0.0), ctx=ctx,
                                       plan=plan)
    # the declared speed ratio exactly (not calibrate()'s per-core probe: on a shared 2-core host its noise,
    # 10-30% between runs, would move the emulated V100 / P100 ratio itself, and the ideal with it)
    slowdown = emulation_slowdown(ctx.cluster, ctx.rank, world)
    for engine in engines.values():
        engine.slowdown = slowdown
    return engines


def hetero_compare(rank: int, world: int, cfg: dict) -> dict:
    """Step times of uniform vs hardware-aware expert counts on the emulated ``cfg["cluster"]``, round by round
    (order alternating); per engine this rank's seconds per step of every round after the warm-up, its expert
    count and the tokens its experts received in the last step."""
    emulation_setup(cfg, rank)
    ctx = wh.init(wh.Config(seed=0, cluster=load_spec(cfg["cluster"])))
    engines = _hetero_engines(ctx, cfg, world)
    x, y = tagged_batch(cfg["batch"], cfg["tokens"], cfg["d"], cfg["experts"])
    times = {n: [] for n in engines}
    for i in range(cfg["warmup"] + cfg["rounds"]):
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            engines[name].step((x, y))
            if i >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
    out = {"slowdown": engines["hardware-aware"].slowdown, "device": ctx.cluster.devices()[rank].name}
    for name, engine in engines.items():
        shards = [m for m in engine.module.modules() if type(m).__name__ == "ExpertParallelMoE"]
        r = shards[0].last_routing
        out[name] = {"times": times[name], "median_s": statistics.median(times[name]), "sizes": shards[0].sizes,
                     "expert_hist": torch.bincount(r.experts[r.keep], minlength=cfg["experts"]).tolist(),
                     "rows": int(r.experts.shape[0])}
    return out


def plot(out: dict, path: str) -> None:
    """PNG: experts and median step time per rank, uniform vs hardware-aware (EMULATED), and the experts'
    parameter bytes per rank vs E with the E/N line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, mem = out["hetero"], out["memory"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [f"rank {i}\n{d}" for i, d in enumerate(h["devices"])]
    width = 0.38
    for j, name in enumerate(("uniform", "hardware-aware")):
        pos = [i + (j - 0.5) * width for i in range(len(labels))]
        axes[0].bar(pos, h[name]["experts_per_rank"], width, label=name)
        axes[1].bar(pos, [1e3 * t for t in h[name]["step_s_per_rank_median"]], width, label=name)
    for ax, title in zip(axes[:2], ("experts per rank", "median step ms per rank (EMULATED)"), strict=True):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.legend(loc="lower center")
    axes[1].set_xlabel(f"speedup {h['measured_speedup']:.3f} (ideal {h['ideal_speedup']:.3f})")
    es = [int(e) for e in mem]
    axes[2].plot(es, [mem[str(e)]["expert_bytes_per_rank"][0] / 2**20 for e in es], "o-", label="experts, measured")
    axes[2].plot(es, [mem[str(e)]["expected_expert_bytes_E_over_N"][0] / 2**20 for e in es], "k--", lw=1,
                 label="E/N x bytes per expert")
    axes[2].plot(es, [mem[str(e)]["dense_bytes_per_rank"][0] / 2**20 for e in es], "s-", label="rest (dense)")
    axes[2].set_xlabel("experts E (4 ranks)")
    axes[2].set_ylabel("parameter MiB per rank")
    axes[2].set_title("parameter bytes per rank")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
