"""ZeRO-3 (:mod:`whale.parallel.zero3`) on inputs that used to break it, world 2 against a one-process
``deepcopy`` reference or an exact error text on every rank:

* frozen parameters anywhere in a unit (the LoRA layout: a frozen base Linear before trainable ones; a frozen
  middle Linear; a whole frozen unit; frozen weights with trainable biases; a frozen final norm and embedding
  in the root, whose only trainable parameter is the head), some toggled between steps, with uneven, zero and
  even shares and with recompute inside the units: the same losses and parameters as one process after 3 steps
  (AdamW with two param groups and a scheduler, clipping), and each unit still freed as soon as its backward
  is over; and in a pipeline stage (DP2 x PP2) that starts with frozen parameters;
* lanes whose control flow differs (a unit called on one lane only; lanes calling different units; lanes that
  agree for the first checked steps, then call equal-sized units in a different order): a ``Zero3Error`` naming
  the collective, the step and each lane's unit on every rank, without waiting for a collective timeout, and
  before the optimizer changes a weight.

Tolerance as in test_zero (fp32, rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM
from tests.test_zero import ATOL, CLIP, RTOL, _batches, _reference, zero_engine, zero_engine_of
from whale.parallel.zero3 import Zero3Error
from whale.parallel.zero3_check import AGREE_STEPS


class Adapter(nn.Module):
    """Residual block x + c(gelu(b(a(ln(x))))) with the parameters whose names start with ``frozen`` frozen;
    [B, T, d] -> [B, T, d]."""

    def __init__(self, d: int, frozen: tuple[str, ...]) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        for name, p in self.named_parameters():
            p.requires_grad_(not name.startswith(frozen))

    def forward(self, x):
        return x + self.c(F.gelu(self.b(self.a(self.ln(x)))))


# per unit: frozen first (a LoRA base, then the adapters), frozen middle, all frozen, frozen weights + trainable biases
LAYOUTS = (("ln", "a"), ("b",), ("ln", "a", "b", "c"), ("ln", "a.weight", "b.weight", "c.weight"))
# before step k: (parameter, requires_grad) set on the model and on the reference
TOGGLES = {1: (("blocks.2.a.weight", True),), 2: (("blocks.1.c.weight", False), ("blocks.3.ln.bias", True))}


def lora_lm() -> TinyLM:
    """TinyLM (untied head) whose blocks are :class:`Adapter` s in :data:`LAYOUTS`; in the root only the head
    trains (its gradient comes first, while the frozen final norm is still needed for the blocks' gradients;
    block 0's input needs no gradient)."""
    torch.manual_seed(0)
    model = TinyLM(stage_layers=(len(LAYOUTS),), tied=False)
    model.blocks = nn.ModuleList(Adapter(16, f) for f in LAYOUTS)
    for frozen in (model.emb, model.ln):
        frozen.requires_grad_(False)
    model.pos.requires_grad_(False)
    return model


def _toggle(model: nn.Module, k: int) -> None:
    for name, flag in TOGGLES.get(k, ()):
        model.get_parameter(name).requires_grad_(flag)


def _frozen_layouts(rank, world, spec):
    cfg = wh.Config(num_micro_batch=2, zero=3, max_grad_norm=CLIP, activation_checkpoint=spec.get("checkpoint"))
    ctx = wh.init(cfg)
    model = lora_lm()
    engine, ref, opt = zero_engine_of(model, ctx, world, spec)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    zero, seen = engine.zero, []

    def probe(module, args, out) -> None:
        """When block 0's output gets its gradient, the later blocks' backward is over: they must be freed."""
        out.register_hook(lambda g: seen.append([u.gathered for u in zero.units]))
    engine.module.blocks[0].register_forward_hook(probe)
    losses = []
    for k, batch in enumerate(_batches(3)):
        _toggle(engine.module, k)
        losses.append(engine.step(batch)["loss"])
        sched.step()
    ref_losses = _reference(ref, 3, before=lambda k: _toggle(ref, k))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    full = engine.full_state_dict()
    if rank == 0:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return {"units": [u.name for u in zero.units], "seen": seen, "pieces": sum(pc.param.numel() for pc in zero.pieces)}


CASES = [{"weights": ((3.0, 1.0),)}, {"weights": ((1.0, 0.0),), "checkpoint": "all"}, {"checkpoint": "all"}]


@pytest.mark.parametrize("spec", CASES, ids=["uneven", "zero-share-recompute", "even-recompute"])
def test_zero3_frozen_parameters_anywhere_match_one_process(spec):
    results = run_ranks(_frozen_layouts, 2, spec, timeout=90)
    assert results[0]["units"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "<root>"]
    for r in results:  # 2 micro-batches x 3 steps; blocks 1-3 freed, block 0 and the root gathered
        assert r["seen"] == [[True, False, False, False, True]] * 6, r["seen"]
    if spec.get("weights") == ((1.0, 0.0),):
        assert results[1]["pieces"] == 0 < results[0]["pieces"]


def _frozen_first_in_a_stage(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=3, max_grad_norm=CLIP, schedule="GPipe"))
    engine, ref, opt = zero_engine(ctx, world, {"layers": (1, 1), "weights": ((1.0, 3.0), (2.0, 1.0))})
    for model in (engine.module, ref):  # the second stage's block: frozen norm and first Linear, trainable fc2
        for name, p in model.named_parameters():
            if name.startswith(("blocks.1.ln.", "blocks.1.fc1.")):
                p.requires_grad_(False)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    losses = []
    for batch in _batches(3):
        losses.append(engine.step(batch)["loss"])
        sched.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, 3)), rtol=RTOL, atol=ATOL)
    full = engine.full_state_dict()
    if rank == 0:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return engine.stage


def test_zero3_frozen_first_in_a_pipeline_stage_matches_one_process():
    """DP2 x PP2, GPipe (both micro-batches' forwards before their backwards): the second stage, one unit whose
    inputs need gradients, starts with frozen parameters."""
    assert sorted(run_ranks(_frozen_first_in_a_stage, 4, timeout=90)) == [0, 0, 1, 1]


# --- lanes whose control flow differs: one clear error on every rank, no hang ---------------------------------
class RoutedLM(TinyLM):
    """TinyLM whose forward runs the blocks ``route(step)`` lists, in that order (every block when ``None``)."""

    route = None
    step = 0

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.size(1)]
        for i in self.route(self.step) if self.route is not None else range(len(self.blocks)):
            x = self.blocks[i](x)
        return self.head(self.ln(x))


ROUTES = {  # case: (rank 0's blocks, rank 1's blocks) from the step where they part
    "one-lane-only": ([0, 1], [0]),
    "different-units": ([0], [1]),
    "swapped-later": ([0, 1], [1, 0]),  # equal-sized units: the collectives match, the training would not
}


def _diverging(rank, world, case):
    ctx = wh.init(wh.Config(num_micro_batch=2, zero=3, timeout_s=20))
    torch.manual_seed(0)
    model = RoutedLM(stage_layers=(2,))
    start = AGREE_STEPS if case == "swapped-later" else 0  # the first unchecked step (0-based)
    model.route = lambda step: ROUTES[case][rank] if step >= start else [0, 1]
    engine = wh.parallelize(model, wh.token_cross_entropy(), torch.optim.AdamW(model.parameters(), lr=1e-2), ctx=ctx)
    batches = _batches(start + 1)
    for k in range(start):
        model.step = k
        engine.step(batches[k])
    before = [pc.param.detach().clone() for pc in engine.zero.pieces]
    model.step = start
    with pytest.raises(Zero3Error) as err:
        engine.step(batches[start])
    assert all(torch.equal(a, pc.param) for a, pc in zip(before, engine.zero.pieces, strict=True))  # no update
    return str(err.value)


FIX = ("; every lane must call the same modules in the same order under ZeRO-3; make control flow depend only "
       "on data all lanes share, or use Config(zero=2)")
EXPECTED = {  # collective #1 of a step is the root's gather, #2 blocks.0's
    "one-lane-only": "at collective #3 of step 1: lane 0 (rank 0) gathers 'blocks.1' for its forward (#1 this "
                     "step), lane 1 (rank 1) <end of forward>",
    "different-units": "at collective #2 of step 1: lane 0 (rank 0) gathers 'blocks.0' for its forward (#1 this "
                       "step), lane 1 (rank 1) gathers 'blocks.1' for its forward (#1 this step)",
    "swapped-later": f"at collective #2 of step {AGREE_STEPS + 1}: lane 0 (rank 0) gathers 'blocks.0' for its "
                     "forward (#1 this step), lane 1 (rank 1) gathers 'blocks.1' for its forward (#1 this step)",
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_zero3_lanes_with_different_control_flow_raise_on_every_rank(case):
    messages = run_ranks(_diverging, 2, case, timeout=45)  # well under the collective timeout (20 s) + setup
    for msg in messages:
        assert re.fullmatch(re.escape(f"ZeRO-3: lanes called different units {EXPECTED[case]}{FIX}"), msg), msg
