"""Train/eval mode in a pipeline: a pipelined model with ``F.dropout(x, p, training=self.training)`` follows
``eval()`` (no dropout in eval, its own masks per stage and micro-batch in training), its traced graph follows the
model's mode, and one that branches on ``self.training`` is refused at plan time, naming the module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.test_buffers_rng import _same


class FunctionalDropPipe(nn.Module):
    """Two replicate(1) stages, each a Linear followed by ``F.dropout(..., training=self.training)``; the
    second also has an ``nn.Dropout``."""

    def __init__(self) -> None:
        super().__init__()
        with wh.replicate(1):
            self.a = nn.Linear(8, 8)
        with wh.replicate(1):
            self.b = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)
            self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = F.dropout(torch.tanh(self.a(x)), 0.5, training=self.training)
        x = F.dropout(torch.tanh(self.b(x)), p=0.5, training=self.training)
        return self.head(self.drop(x))


def _functional_dropout(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    model = FunctionalDropPipe()
    ref = copy.deepcopy(model).eval()
    engine = wh.parallelize(model, F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.0), ctx=ctx)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    with torch.no_grad():
        ref_eval = float(F.cross_entropy(ref(x), y))
    masks: dict = {}
    for name, m in engine.module.named_modules():
        if type(m).__name__ == "ModeSwitch":
            m.register_forward_hook(lambda mod, args, out, n=name: masks.setdefault(n, []).append(out != 0))
    evals = [engine.eval_step((x, y))["loss"] for _ in range(2)]
    trains = [engine.step((x, y))["loss"] for _ in range(2)]  # lr 0: only dropout changes the loss
    return {"evals": evals, "ref_eval": ref_eval, "trains": trains, "masks": masks, "stage": engine.stage}


def test_functional_dropout_follows_eval_in_a_pipeline():
    results = run_ranks(_functional_dropout, 2)
    for r in results:
        assert r["evals"] == pytest.approx([r["ref_eval"]] * 2, rel=1e-6)  # no dropout in eval
        assert all(abs(t - r["ref_eval"]) > 1e-4 for t in r["trains"])  # dropout in training
        assert r["trains"][0] != r["trains"][1]
    (m0,), (m1,) = (list(r["masks"].values()) for r in sorted(results, key=lambda r: r["stage"]))
    assert len(m0) == 2 * 2 + 2 * 2  # two eval steps and two training steps of 2 micro-batches each
    trained0, trained1 = m0[4:], m1[4:]
    assert all(bool(m.all()) for m in m0[:4])  # eval: nothing dropped
    assert not _same(trained0[0], trained1[0])  # stage 0 and stage 1 of one lane draw their own masks
    assert not _same(trained0[0], trained0[1])  # and each micro-batch its own


def test_functional_dropout_trace_honours_mode():
    from whale.frontend.graph import ModeSwitch, trace

    model = FunctionalDropPipe()
    gm = trace(model)
    assert sum(isinstance(m, ModeSwitch) for m in gm.modules()) == 2
    assert model.training and all(m.training for m in model.modules())  # modes restored after tracing
    x = torch.randn(4, 8)
    gm.eval()
    torch.testing.assert_close(gm(x), model.eval()(x), rtol=0, atol=0)
    gm.train()
    model.train()  # the traced calls follow the model's own mode too (the mode of the module making the call)
    assert not torch.equal(gm(x), model(x))


class BranchOnMode(nn.Linear):
    def forward(self, x):
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        return super().forward(x)


class BranchPipe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with wh.replicate(1):
            self.a = BranchOnMode(8, 8)
        with wh.replicate(1):
            self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.a(x))


def test_branching_on_training_is_refused_at_plan_time_naming_the_module():
    with pytest.raises(wh.StageError, match=r"a \(BranchOnMode\).*self\.training.*Fix: .*nn\.Dropout"):
        wh.plan_model(BranchPipe(), 2, wh.Config(num_micro_batch=2))
