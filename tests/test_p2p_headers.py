"""Stage-boundary transfers whose description changes between steps (another batch size, train then eval):
the receiver posts the first tensors' receives early from the previous step's description, so a change must
go through the placeholder path (parallel/p2p.py) and still train exactly like one process."""

from __future__ import annotations

import copy

import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, lm_loss, reference_step

RTOL, ATOL = 1e-5, 1e-6


def _changing_shapes(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    model = TinyLM(stage_layers=(1, 1) if world == 2 else (1, 1, 1), tied=False)
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    got, want = [], []
    for kind, rows in [("step", 8), ("step", 8), ("step", 4), ("eval", 8), ("step", 8), ("eval", 4), ("eval", 4),
                       ("step", 6), ("step", 6)]:
        x, y = lm_batches(1, rows, seed=rows)[0]
        if kind == "step":
            got.append(engine.step((x, y))["loss"])
            want.append(reference_step(ref_opt, lm_loss(ref(x), y)))
        else:
            got.append(engine.eval_step((x, y))["loss"])
            with torch.no_grad():
                want.append(lm_loss(ref(x), y).item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    return got


def test_batch_size_and_mode_changes_between_steps_two_stages():
    results = run_ranks(_changing_shapes, 2)
    assert results[0] == results[1]


def test_batch_size_and_mode_changes_between_steps_three_stages():
    run_ranks(_changing_shapes, 3)
