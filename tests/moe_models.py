"""Models and the distributed worker of the MoE tests (tests/test_moe.py): a replicate model whose MoE layer is
under a nested split (expert parallelism) and a one-process ``deepcopy`` reference trained side by side."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.test_split_runtime import _with_shard_weights as with_shard_weights  # noqa: F401 (re-export)


class MoENet(nn.Module):
    """``[B, T, 6] -> [B, T, 3]``: Linear, residual MoE (under a split nested in the replicate), Linear."""

    def __init__(self, experts=4, top_k=2, capacity_factor=None, count=None, d=8, d_ff=12):
        super().__init__()
        with wh.replicate(count):
            self.inp = nn.Linear(6, d)
            with wh.split(count):
                self.moe = wh.MoE(d, d_ff, experts, top_k, capacity_factor, aux_loss_coef=0.1, z_loss_coef=0.01)
            self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.moe(h))


class PipeMoENet(nn.Module):
    """Two pipeline stages of 2 devices: ``inp``; then the MoE (expert parallel over the stage's 2 devices) and
    ``out``."""

    def __init__(self, experts=4, top_k=2, capacity_factor=None, count=None, d=8, d_ff=12):
        super().__init__()
        with wh.replicate(2):
            self.inp = nn.Linear(6, d)
        with wh.replicate(2):
            with wh.split(2):
                self.moe = wh.MoE(d, d_ff, experts, top_k, capacity_factor, aux_loss_coef=0.1, z_loss_coef=0.01)
            self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + self.moe(h))


def batches(spec, steps):
    g = torch.Generator().manual_seed(1)
    b, t = spec["batch"], spec.get("tokens", 5)
    return [(torch.randn(b, t, 6, generator=g) * 2, torch.randn(b, t, 3, generator=g)) for _ in range(steps)]


def compare(rank, world, spec):
    """3 AdamW steps of the engine and of a one-process reference; returns losses, full state, drop masks."""
    from whale.parallel.split_ops import comm_bytes

    ctx = wh.init(wh.Config(num_micro_batch=spec.get("mb", 1), load_shares=spec.get("shares"), seed=0,
                            zero=spec.get("zero", 0), capture="export" if spec.get("export") else "fx",
                            max_grad_norm=spec.get("clip"), precision=spec.get("precision", "fp32")))
    net = PipeMoENet if spec.get("pipe") else MoENet
    model = net(spec.get("experts", 4), spec.get("top_k", 2), spec.get("cf"), spec.get("count"))
    if spec.get("frozen"):  # a frozen non-expert parameter: no gradient, no sync, no update
        model.inp.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    data = batches(spec, spec.get("steps", 3))
    sample = data[0] if spec.get("export") else None
    plan = with_shard_weights(wh.plan_model(model, world, ctx.config, sample_batch=sample), spec.get("shard_weights"))
    opt, ref_opt, sched, ref_sched = _optimizers(model, ref, spec)
    engine = wh.parallelize(model, lambda out, y: F.mse_loss(out, y) + wh.moe_aux_loss(model), opt, ctx=ctx,
                            plan=plan)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=spec.get("precision") == "bf16")
    comm_bytes.clear()
    out = {"losses": [], "ref_losses": [], "keep": [], "ref_keep": [], "plan": plan.to_json(), "plan_text": str(plan)}
    for x, y in data:
        out["losses"].append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        with autocast:
            y_ref = ref(x)
        loss = F.mse_loss(y_ref.float(), y) + wh.moe_aux_loss(ref)
        loss.backward()
        if spec.get("clip"):
            torch.nn.utils.clip_grad_norm_(ref.parameters(), spec["clip"])
        ref_opt.step()
        for s in (sched, ref_sched):
            if s is not None:
                s.step()
        out["ref_losses"].append(loss.item())
        region = _moe_region(engine)
        if region is not None:
            rows = plan.micro_batch_rows(len(x), engine.stage)[engine.lane][-1]  # the last micro-batch's rows
            out["keep"].append(region.sharded.last_routing.keep.tolist())
            out["ref_keep"].append(ref.moe.last_routing.keep[rows[0]:rows[1]].tolist())
    out["lrs"] = [g["lr"] for g in ref_opt.param_groups] if sched is not None else None
    out["sizes"] = _moe_region(engine).sharded.sizes if _moe_region(engine) is not None else None
    out["bytes"] = dict(comm_bytes)
    state = engine.full_state_dict()
    if rank == 0:
        out["state"] = {k: v.tolist() for k, v in state.items()}
        out["ref_state"] = {k: v.tolist() for k, v in ref.state_dict().items()}
    return out


def _optimizers(model, ref, spec):
    """The engine's optimizer (a factory, or with ``spec["groups"]`` the user's own AdamW instance with param
    groups: experts, router and the rest at different LRs, biases without weight decay, and a LambdaLR
    schedule) and the reference's twin; schedulers are ``None`` without groups."""
    if not spec.get("groups"):
        return (lambda ps: torch.optim.AdamW(ps, lr=1e-2)), torch.optim.AdamW(ref.parameters(), lr=1e-2), None, None

    def groups(m):
        named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        experts = [p for n, p in named if n.startswith("moe.") and not n.startswith("moe.router")]
        router = [p for n, p in named if n.startswith("moe.router")]
        rest = [p for n, p in named if not n.startswith("moe.")]
        return [{"params": experts, "lr": 2e-2}, {"params": router, "lr": 5e-3, "weight_decay": 0.0},
                {"params": rest, "weight_decay": 0.05}]

    opt, ref_opt = (torch.optim.AdamW(groups(m), lr=1e-2) for m in (model, ref))
    warm = [lambda s: min(1.0, (s + 1) / 2), lambda s: 0.5 ** s, lambda s: 1.0]
    sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, warm) for o in (opt, ref_opt))
    return opt, ref_opt, sched, ref_sched


def _moe_region(engine):
    return next((r for r in engine.split.regions if getattr(r.sharded, "is_moe", False)), None)


def resume(rank, world, path, weights, save):
    """2 steps, save (``save``) or load a checkpoint, then 2 more steps; returns the last 2 losses and sizes."""
    ctx = wh.init(wh.Config(seed=0))
    model = MoENet(experts=5)
    plan = with_shard_weights(wh.plan_model(model, world, ctx.config), weights)
    engine = wh.parallelize(model, lambda out, y: F.mse_loss(out, y) + wh.moe_aux_loss(model),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx, plan=plan)
    data = batches({"batch": 8}, 4)
    if save:
        for x, y in data[:2]:
            engine.step((x, y))
        engine.save_checkpoint(path)
    else:
        engine.load_checkpoint(path)
    return [engine.step((x, y))["loss"] for x, y in data[2:]], _moe_region(engine).sharded.sizes
