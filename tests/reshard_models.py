"""The model of the resharding tests, annotated five ways with the same FQNs (issue 15).

``ReshardNet``: token ids [B, T] -> class logits [B, C]: a tied input embedding / vocabulary projection
(``emb.weight`` is ``lm.weight``), four blocks, and a classification ``head`` over the vocabulary logits of the
last token. Layouts (name: world size):

- ``dp4`` (4): no annotation, data parallel over 4 ranks;
- ``dp2pp2`` (4): two pipeline stages of width 2 (blocks 0-1, 2-3), the tie across the stages;
- ``pp4`` (4): four stages of one block each, ``emb`` in the first and ``lm`` (tied) in the last;
- ``split2`` (2): the model replicated over 2 ranks with the head split (nested) over the same 2 ranks with uneven shard
  sizes (weights 3:1, so 8 and 2 of its 10 classes);
- ``one`` (1): one process.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.models import Block

LAYOUTS = {"dp4": 4, "dp2pp2": 4, "pp4": 4, "split2": 2, "one": 1}
VOCAB, CLASSES, SEQ = 32, 10, 6


class ReshardNet(nn.Module):
    """[B, T] int64 -> [B, CLASSES] logits (class-sharded under ``split2``), annotated as ``layout`` says."""

    def __init__(self, layout: str, d: int = 16) -> None:
        super().__init__()
        split = layout == "split2"
        with wh.replicate(None) if split else _nothing():
            self.emb = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.1)
            blocks = []
            for stage in {"dp2pp2": [(2, 2), (2, 2)], "pp4": [(1, 1)] * 4}.get(layout, [(4, None)]):
                n, width = stage
                with wh.replicate(width) if width else _nothing():
                    blocks += [Block(d) for _ in range(n)]
            self.blocks = nn.ModuleList(blocks)
            self.ln = nn.LayerNorm(d)
            self.lm = nn.Linear(d, VOCAB, bias=False)
            self.lm.weight = self.emb.weight
            with wh.split(None) if split else _nothing():
                self.head = nn.Linear(VOCAB, CLASSES)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.size(1)]
        for b in self.blocks:
            x = b(x)
        return self.head(self.lm(self.ln(x))[:, -1])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def batches(steps: int, batch: int = 8, seed: int = 5):
    """Deterministic (x [batch, SEQ] int64, y [batch] int64) pairs."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(steps)]


def engine(layout: str, ctx, seed: int = 0, lr: float = 1e-2, zero_weights=None):
    """The engine of ``layout`` (2 micro-batches; split head at shard weights 3:1; ZeRO lane shares
    ``zero_weights`` per stage when given) with AdamW in two param groups (no weight decay for 1-dim tensors)."""
    torch.manual_seed(seed)
    model = ReshardNet(layout)
    plan = wh.plan_model(model, ctx.world_size, ctx.config)
    if zero_weights is not None:
        plan = dataclasses.replace(plan, zero_weights=zero_weights)
    if layout == "split2":
        plan = dataclasses.replace(plan, task_graphs=tuple(
            dataclasses.replace(tg, nested=tuple(dataclasses.replace(n, shard_weights=(3.0, 1.0)) for n in tg.nested))
            for tg in plan.task_graphs))
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)
    return wh.parallelize(model, wh.cross_entropy, opt, ctx=ctx, plan=plan)


def plain_loss(out, y):
    """The one-process reference's loss."""
    return F.cross_entropy(out, y)


# --- the save/load matrix (also run by benchmarks/reliability.py) -------------------------------------------
def whole_state(e) -> dict:
    """Every whole tensor of the engine's checkpoint (model and optimizer, keyed as saved), collective (ZeRO-3:
    inside ``e.zero.whole()``, as the engine saves)."""
    from whale.runtime.fqn_state import model_slots, whole_model_state, whole_optim_state

    with e.zero.whole() if e.zero is not None else contextlib.nullcontext():
        slots = model_slots(e.module)
        out = whole_model_state(slots)
        out.update(whole_optim_state(e.optimizer, slots, e.plan, e.zero))
    return out


def save_layout(rank, world, layout, root, steps=2, zero=0, zero_weights=None):
    """Train ``layout`` (with ZeRO stage ``zero``, lane shares ``zero_weights``) for ``steps`` steps and save it
    under ``root/layout``; returns the whole state, the hyperparameters and the RNG state it saved."""
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, zero=zero))
    e = engine(layout, ctx, zero_weights=zero_weights)
    for b in batches(steps):
        e.step(b)
    e.optimizer.param_groups[0]["lr"] = 0.0123  # as a scheduler would have set it
    state = whole_state(e)
    rng = torch.get_rng_state()
    e.save_checkpoint(f"{root}/{layout}", extra={"position": steps})
    return {"state": state, "lr": [g["lr"] for g in e.optimizer.param_groups], "rng": rng}


def load_layouts(rank, world, layout, root, sources, zero=0, zero_weights=None):
    """Under ``layout`` (ZeRO stage ``zero``, lane shares ``zero_weights``), load each of ``sources`` (fresh
    engine, another init) and return what it holds."""
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, zero=zero))
    out = {}
    for source in sources:
        e = engine(layout, ctx, seed=100, zero_weights=zero_weights)
        torch.manual_seed(7)  # the RNG must come from the checkpoint
        extra = e.load_checkpoint(f"{root}/{source}")
        out[source] = {"state": whole_state(e), "lr": [g["lr"] for g in e.optimizer.param_groups],
                       "rng": torch.get_rng_state(), "step": e.steps_done, "extra": extra}
    return out


def _union(per_rank: list[dict]) -> dict:
    """The whole tensors of all ranks together (every rank's copy of a key must be identical)."""
    out: dict = {}
    for d in per_rank:
        for k, v in d.items():
            if k in out and not torch.equal(out[k], v):
                raise AssertionError(f"ranks disagree on {k}")
            out.setdefault(k, v)
    return out


def compare(saved: list[dict], loaded: list[dict]) -> list[str]:
    """Differences between a save (per-rank results of :func:`save_layout`) and one load of it (per-rank
    entries of :func:`load_layouts`); empty when bitwise equal."""
    want, got = _union([r["state"] for r in saved]), _union([r["state"] for r in loaded])
    problems = []
    if set(want) != set(got):
        problems.append(f"keys differ: only saved {sorted(set(want) - set(got))[:4]}, "
                        f"only loaded {sorted(set(got) - set(want))[:4]}")
    for k in sorted(set(want) & set(got)):
        a, b = want[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1), b.view(-1)):
            problems.append(f"{k} differs")
    for r in loaded:
        if r["lr"] != saved[0]["lr"] or not torch.equal(r["rng"], saved[0]["rng"]) or r["step"] != 2 \
                or r["extra"] != {"position": 2}:
            problems.append("lr, rng, step or extra not restored")
    return problems


def matrix(root: str, sources, targets, timeout: float = 300) -> dict[tuple[str, str], list[str]]:
    """Save under every source layout, load each under every target layout; ``{(source, target): problems}``."""
    from tests.distributed import run_ranks

    saved = {s: run_ranks(save_layout, LAYOUTS[s], s, root, timeout=timeout) for s in sources}
    out = {}
    for t, wanted in targets.items():
        loaded = run_ranks(load_layouts, LAYOUTS[t], t, root, list(wanted), timeout=timeout)
        for s in wanted:
            out[(s, t)] = compare(saved[s], [r[s] for r in loaded])
    return out
