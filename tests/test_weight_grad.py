"""The zero-bubble backward split (:mod:`whale.parallel.weight_grad`) equals a plain backward, in one process.

B (:func:`backward_input`) then W (:func:`backward_weight`) against ``torch.autograd.backward`` on a copy: the
inputs' and parameters' gradients, bit for bit where no parameter is tied within the stage (the same nodes
compute the same products), within fp32 rounding where one is; W runs only weight-gradient products.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from whale.parallel.weight_grad import backward_input, backward_weight


class Block(nn.Module):
    """x + W2 gelu(W1 x), [B, d] -> [B, d]."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stage(nn.Module):
    """Blocks, a LayerNorm, optionally a tied reuse of the first layer, an output of parameters only, a
    checkpointed block; returns ``(h, extra)``, ``extra`` from the side input (``[B, d]``) and parameters."""

    def __init__(self, d: int = 8, tied: bool = False, param_only: bool = False, ckpt: bool = False,
                 hook: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.norm, self.side = nn.LayerNorm(d), nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(d))
        self.tied, self.param_only, self.ckpt = tied, param_only, ckpt
        self.hooked = nn.Linear(d, d) if hook else None

    def forward(self, x, s):
        h = checkpoint(self.blocks[0], x, use_reentrant=False) if self.ckpt else self.blocks[0](x)
        if self.hooked is not None:  # a gradient hook on a Linear's output (a frontier node's): doubles it once
            h = self.hooked(h)
            h.register_hook(lambda g: g * 2)
            h = F.gelu(h)
        h = self.norm(self.blocks[1](h))
        if self.tied:
            h = self.blocks[0].fc2(F.gelu(self.blocks[0].fc1(h))) + h
        extra = self.side(s) * self.bias if self.param_only else self.side(s) + h
        return h, extra


def _run(stage: Stage, split: bool, x: torch.Tensor, s: torch.Tensor, gh: torch.Tensor, ge: torch.Tensor,
         micro_batches: int = 2, amp: bool = False):
    """Forward (under bf16 autocast with ``amp``) + backward over ``micro_batches`` micro-batches (gradients
    accumulate); returns the leaves' gradients per micro-batch and the parameters' gradients."""
    leaves_grads = []
    params = [p for p in stage.parameters() if p.requires_grad]
    for _ in range(micro_batches):
        xi, si = x.clone().requires_grad_(), s.clone()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            h, extra = stage(xi, si)
        h, extra = h.float(), extra.float()
        if split:
            got, work = backward_input([h, extra], [gh, ge], [xi], params)
            assert all(p.grad is None for p in params) or leaves_grads  # B touches no parameter gradient
            backward_weight(work)
            leaves_grads.append(got[0])
        else:
            torch.autograd.backward([h, extra], [gh, ge])
            leaves_grads.append(xi.grad)
    return leaves_grads, {n: p.grad for n, p in stage.named_parameters()}


def _data(d: int = 8, rows: int = 5):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, d, generator=g) for _ in range(4)]


@pytest.mark.parametrize("kw", [{}, {"param_only": True}, {"ckpt": True}, {"amp": True}, {"hook": True}],
                         ids=["chain", "param-only", "ckpt", "bf16-autocast", "gradient-hook"])
def test_split_backward_is_the_plain_backward_bit_for_bit(kw):
    torch.manual_seed(0)
    amp = kw.pop("amp", False)
    stage = Stage(**kw)
    ref = copy.deepcopy(stage)
    data = _data()
    got_x, got_p = _run(stage, True, *data, amp=amp)
    ref_x, ref_p = _run(ref, False, *data, amp=amp)
    for a, b in zip(got_x, ref_x, strict=True):
        assert torch.equal(a, b)
    for name, g in ref_p.items():
        assert (got_p[name] is None and g is None) or torch.equal(got_p[name], g), name


def test_tied_use_within_the_stage_matches_within_rounding():
    torch.manual_seed(0)
    stage = Stage(tied=True)
    ref = copy.deepcopy(stage)
    data = _data()
    got_x, got_p = _run(stage, True, *data)
    ref_x, ref_p = _run(ref, False, *data)
    for a, b in zip(got_x, ref_x, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for name, g in ref_p.items():
        torch.testing.assert_close(got_p[name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert got_p["blocks.0.fc1.weight"] is not None


def test_no_input_gradients_means_w_is_the_whole_backward():
    """Stage 0 (inputs need no gradient): B does nothing, W is the plain backward."""
    torch.manual_seed(0)
    stage = Stage()
    ref = copy.deepcopy(stage)
    x, s, gh, ge = _data()
    params = list(stage.parameters())
    got, work = backward_input(list(stage(x, s)), [gh, ge], [], params)
    assert got == () and all(p.grad is None for p in params)
    backward_weight(work)
    torch.autograd.backward(list(ref(x, s)), [gh, ge])
    for (name, p), q in zip(stage.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name


class _Count(TorchDispatchMode):
    """Counts matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def test_w_runs_only_weight_gradient_products_and_fires_accumulate_hooks():
    """W makes one product per Linear (its weight gradient), none on the activation chain; B none of those;
    post-accumulate-grad hooks (gradient sync) fire in W only, once per parameter."""
    torch.manual_seed(0)
    stage = Stage()
    x, s, gh, ge = _data()
    xi = x.clone().requires_grad_()
    params = [p for n, p in stage.named_parameters() if n != "bias"]  # bias: used only with param_only
    fired: list[int] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda t: fired.append(id(t)))
    h, extra = stage(xi, s)
    with _Count() as b:
        _, work = backward_input([h, extra], [gh, ge], [xi], params)
    assert not fired
    with _Count() as w:
        backward_weight(work)
    linears = sum(isinstance(m, nn.Linear) for m in stage.modules())
    assert w.mm == linears  # fc1, fc2 of both blocks, side: weight gradients only
    assert b.mm == 4  # input gradients of the chain's four Linears (the side input needs none)
    assert sorted(fired) == sorted(id(p) for p in params)


class _Linear(torch.autograd.Function):
    """``x @ w.T`` as a Python autograd Function (a frontier node that autograd does not own from Python)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def test_python_function_frontier_survives_dropping_the_outputs_before_w():
    """The executor drops a micro-batch's outputs before its W: the kept frontier nodes alone (here a Python
    Function's node, the topmost one) keep what W needs."""
    import gc

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    out = _Linear.apply(torch.tanh(x), w)
    got, work = backward_input([out], [g], [x], [w])
    del out
    gc.collect()
    backward_weight(work)
    x2 = x.detach().requires_grad_()
    torch.autograd.backward([_Linear.apply(torch.tanh(x2), w)], [g], inputs=[w])
    assert torch.equal(got[0], torch.autograd.grad(_Linear.apply(torch.tanh(x2), w), x2, g)[0])
    assert torch.equal(w.grad, 2 * (g.t() @ torch.tanh(x)))  # W, then the plain backward: the same sum twice
