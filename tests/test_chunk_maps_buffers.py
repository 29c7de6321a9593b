"""BatchNorm buffers on interleaved chunk maps train like one process doing the same gradient accumulation.

An interleaved pipeline (p = 2, v = 2, world 2, 4 micro-batches, gloo ranks of :mod:`tests.distributed`) of a
4-chunk model with a BatchNorm1d in every chunk (momentum 0.1, one with ``momentum=None``, one without affine
parameters), on the standard map (0, 1, 0, 1) and on the given map (0, 1, 0, 0) (stage 0 holds chunks 0, 2 and
3, so two of its chunks hand values to each other locally). Each chunk's BatchNorm sees the micro-batches in
order (``F0 .. F3`` per chunk in every schedule), so its running statistics after every step, the parameters
and the losses equal a one-process ``deepcopy`` accumulating gradients over the same 4 micro-batches (AdamW
lr 1e-3, fp32, rtol 1e-5 / atol 1e-6, and the reference step of :mod:`tests.test_buffers_rng`); eval uses the
running statistics.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.test_buffers_rng import _ref_step

RTOL, ATOL, STEPS, MB, BATCH = 1e-5, 1e-6, 3, 4, 16
MAPS = {"standard": (0, 1, 0, 1), "given": (0, 1, 0, 0)}


class BNChunks(nn.Module):
    """[B, 6] -> [B, 5]: four replicate(1) scopes (the interleaved chunks), each Linear, BatchNorm1d, ReLU; the
    second BatchNorm with cumulative averaging (``momentum=None``), the third without affine parameters."""

    def __init__(self) -> None:
        super().__init__()
        dims, layers = [6, 8, 8, 8, 5], []
        for i in range(4):
            with wh.replicate(1):
                bn = nn.BatchNorm1d(dims[i + 1], momentum=None if i == 1 else 0.1, affine=i != 2)
                layers.append(nn.Sequential(nn.Linear(dims[i], dims[i + 1]), bn, nn.ReLU() if i < 3 else nn.Identity()))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


def _batches(steps: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 6, generator=g) * 1.5 + 0.3, torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(steps)]


def _compare(rank, world, where):
    config = wh.Config(num_micro_batch=MB, schedule="Interleaved1F1B", virtual_stages=2, seed=0)
    ctx = wh.init(config)
    model = BNChunks()
    plan = dataclasses.replace(wh.plan_model(BNChunks(), 2, config), chunk_positions=MAPS[where])
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, F.cross_entropy, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx, plan=plan)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for step, (x, y) in enumerate(_batches(STEPS)):
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(_ref_step(ref, ref_opt, x, y, MB))
        full = engine.full_state_dict()  # the whole model on rank 0
        for name, value in (ref.state_dict().items() if rank == 0 else ()):  # parameters and running statistics
            torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, s=step: f"{n} after step {s + 1}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    x, y = _batches(1, seed=9)[0]
    ev = engine.eval_step((x, y))["loss"]
    ref.eval()
    with torch.no_grad():
        ref_eval = float(F.cross_entropy(ref(x), y))
    return {"plan": engine.plan.to_json(), "eval": ev, "ref_eval": ref_eval,
            "running": sorted(n for n in full if "running_mean" in n) if rank == 0 else None}


@pytest.mark.parametrize("where", list(MAPS))
def test_batchnorm_on_chunk_maps_matches_one_process(where):
    results = run_ranks(_compare, 2, where, timeout=180)
    assert wh.Plan.from_json(results[0]["plan"]).chunk_positions == MAPS[where]
    assert results[0]["running"] == [f"layers.{i}.1.running_mean" for i in range(4)]
    for r in results:
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=RTOL, abs=ATOL)
