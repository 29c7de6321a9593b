"""Model and analysis (no processes) for :mod:`benchmarks.heterogeneous`: the token MLP, its per-layer
profile, the ideal/fluid/simulated pipeline speedups and the memory-bound case's numbers."""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._models import Block
from benchmarks._paired import summary


# --- model ---------------------------------------------------------------------------------------------------
class TokenMLP(nn.Module):
    """``layers`` equal blocks; with ``stages > 1`` they are built in ``stages`` contiguous, as-even-as-possible
    groups, each inside ``wh.replicate(1)`` (one pipeline stage each; earlier stages get the remainder)."""

    def __init__(self, dim: int, layers: int, stages: int = 1) -> None:
        super().__init__()
        import whale as wh

        q, r = divmod(layers, stages)
        blocks: list[nn.Module] = []
        for s in range(stages):
            with wh.replicate(1) if stages > 1 else contextlib.nullcontext():
                blocks.extend(Block(dim) for _ in range(q + (1 if s < r else 0)))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(out, y):
    """Mean squared error over the rows given (a mean, as Whale requires)."""
    return F.mse_loss(out, y)


def make_batch(rows: int, tokens: int, dim: int, seed: int = 1):
    """A fixed global batch ``(x, y)`` of shape [rows, tokens, dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, tokens, dim, generator=g), torch.randn(rows, tokens, dim, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)



# --- analysis (no processes) ---------------------------------------------------------------------------------
def layer_profile(dim: int, layers: int, tokens: int):
    """Per-block forward/backward FLOPs per sample and the rest (loss), from Whale's fake-tensor profiler."""
    from whale.frontend import hwplan

    model = TokenMLP(dim, layers)
    prof = hwplan.profile(model, make_batch(2, tokens, dim))
    fwd = [u.forward_flops for u in prof.units]
    bwd = [u.backward_flops for u in prof.units]
    return fwd, bwd, prof.rest.forward_flops, prof.rest.backward_flops, prof


def stage_work(counts, fwd, bwd, rest_f, rest_b):
    """(forward, backward) FLOPs per sample of each stage of a cut; the rest (loss) on the last stage."""
    out, a = [], 0
    for s, c in enumerate(counts):
        f, b = sum(fwd[a:a + c]), sum(bwd[a:a + c])
        if s == len(counts) - 1:
            f, b = f + rest_f, b + rest_b
        out.append((f, b))
        a += c
    return out


def bottleneck(counts, fwd, bwd, rest_f, rest_b, speeds) -> float:
    """Slowest stage's (forward + backward) time per sample at the stage devices' speeds."""
    return max((f + b) / v for (f, b), v in zip(stage_work(counts, fwd, bwd, rest_f, rest_b), speeds, strict=True))


def best_cut(fwd, bwd, rest_f, rest_b, speeds) -> list[int]:
    """Contiguous cut minimizing the slowest stage, by brute force over every composition (few layers)."""
    n, s = len(fwd), len(speeds)
    best, arg = float("inf"), None
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        counts = [bounds[i + 1] - bounds[i] for i in range(s)]
        t = bottleneck(counts, fwd, bwd, rest_f, rest_b, speeds)
        if t < best - 1e-15:
            best, arg = t, counts
    return arg


def simulate_1f1b(fwd_t: list[float], bwd_t: list[float], m: int) -> float:
    """Makespan of a 1F1B step with per-stage forward/backward seconds per micro-batch, communication free
    (Whale's own event simulator, :func:`whale.plan.schedule_sim.simulate`)."""
    from whale.plan.schedule import make_schedule
    from whale.plan.schedule_sim import simulate

    return simulate(make_schedule("1F1B", len(fwd_t), m), list(fwd_t), list(bwd_t))["step"]


def pp_analysis(res: dict, fwd, bwd, rest_f, rest_b) -> dict:
    """Ideal, fluid and simulated speedups of the hardware-aware cut over the uniform cut (see top)."""
    from whale.cluster import CATALOG

    speeds = {name: CATALOG[name].fp32_flops for name in res["devices"]}

    def stage_speeds(variant):
        return [speeds[res["devices"][r]] for r in res[variant]["stage_ranks"]]

    sp_u, sp_a = stage_speeds("uniform"), stage_speeds("aware")
    t_uni = bottleneck(res["uniform"]["counts"], fwd, bwd, rest_f, rest_b, sp_u)
    best = best_cut(fwd, bwd, rest_f, rest_b, sp_a)
    t_best = bottleneck(best, fwd, bwd, rest_f, rest_b, sp_a)
    t_aware = bottleneck(res["aware"]["counts"], fwd, bwd, rest_f, rest_b, sp_a)
    t_fluid = (sum(fwd) + sum(bwd) + rest_f + rest_b) / sum(sp_a)
    m = res["num_micro_batch"]

    def sim(counts, sp):
        work = stage_work(counts, fwd, bwd, rest_f, rest_b)
        return simulate_1f1b([f / v for (f, _), v in zip(work, sp, strict=True)],
                             [b / v for (_, b), v in zip(work, sp, strict=True)], m)

    sim_u, sim_best, sim_a = sim(res["uniform"]["counts"], sp_u), sim(best, sp_a), sim(res["aware"]["counts"], sp_a)
    paired = summary(res["aware"]["times"], res["uniform"]["times"], goal=0.9 * t_uni / t_best,
                     names=("aware", "uniform"))  # rounds alternate uniform/aware (ABBA): adjacent pairs
    measured = paired["median"]
    return {"measured_speedup_paired": paired, "best_counts": best,
            "uniform_bottleneck": t_uni, "best_bottleneck": t_best,
            "aware_bottleneck": t_aware, "fluid_bottleneck": t_fluid,
            "ideal_speedup": t_uni / t_best, "fluid_speedup": t_uni / t_fluid,
            "aware_cut_speedup": t_uni / t_aware, "bound_speedup": sim_u / sim_best,
            "sim_aware_speedup": sim_u / sim_a, "measured_speedup": measured,
            "fraction_of_ideal": measured / (t_uni / t_best), "fraction_of_bound": measured / (sim_u / sim_best)}


def memory_scale_for(prof, devices, batch: int, slack: float) -> float:
    """``memory_scale`` at which the whole cluster holds the job's static bytes on every device plus the
    activations of ``(1 + slack) x batch`` samples."""
    cap = sum(d.memory_bytes for d in devices)
    return (len(devices) * prof.static_bytes + (1 + slack) * batch * prof.activation_bytes) / cap


def mem_analysis(res: dict, prof) -> dict:
    """Bytes each device would need under FLOPS-proportional shares and under the plan's shares."""
    from whale.cluster import CATALOG
    from whale.plan.shares import whole_shares

    devs = [CATALOG[n] for n in res["devices"]]
    caps = [d.memory_bytes * res["memory_scale"] for d in devs]
    flops_rows = whole_shares(res["batch"], [d.fp32_flops for d in devs])

    def need(rows):
        return [prof.static_bytes + r * prof.activation_bytes for r in rows]

    out = {"capacity_bytes": caps, "flops_rows": flops_rows, "flops_need_bytes": need(flops_rows),
           "flops_overflow": any(n > c for n, c in zip(need(flops_rows), caps, strict=True)),
           "static_bytes": prof.static_bytes, "activation_bytes_per_sample": prof.activation_bytes,
           "plan_rows": None, "plan_need_bytes": None, "plan_fits": False}
    if "aware" in res:
        rows = res["aware"]["rows"]
        out.update(plan_rows=rows, plan_need_bytes=need(rows),
                   plan_fits=all(n <= c for n, c in zip(need(rows), caps, strict=True)))
    return out


