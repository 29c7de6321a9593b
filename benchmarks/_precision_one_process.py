"""bf16 vs fp32 in ONE process (no Whale): the GPT main job's model, data and LR schedule under plain
``torch.autocast``, to tell a precision cost from run-to-run noise (docs/benchmarks.md, "Precision").

    python benchmarks/_precision_one_process.py VARIANT STEPS [LR]

VARIANT: ``fp32``, ``fp32_seed2`` (init seed 1338 instead of 1337), ``bf16`` (autocast on the whole forward),
``bf16_head32`` (autocast, but the tied LM head in fp32). Prints the training loss every 50 steps and
``FINAL variant steps held-out-loss`` (the job's 8 fixed held-out batches). bf16 matmuls are ~11x slower than
fp32 on an AVX2-only CPU: 200 bf16 steps take ~40 min on one core.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src"), os.path.join(os.path.dirname(__file__), "..")]
from examples.gpt.data import DEFAULT_DATA_DIR, TokenBatches, eval_batches, load_tokens  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402


def main(variant: str, steps: int, lr: float = 3e-3) -> float:
    """Train ``steps`` steps (batch 32 x 128 tokens, AdamW(0.9, 0.95), weight decay 0.1, 5% warmup, cosine to
    10%); returns the final held-out loss in nats."""
    torch.set_num_threads(1)
    train, val = (load_tokens(DEFAULT_DATA_DIR / f) for f in ("train.bin", "val.bin"))
    torch.manual_seed(1338 if variant.endswith("seed2") else 1337)
    model = GPT(GPTConfig(vocab_size=2048, block_size=128))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    if variant == "bf16_head32":
        def head(x):
            with torch.autocast("cpu", enabled=False):
                return F.linear(x.float(), model.lm_head.weight)
        model.lm_head.forward = head

    def loss_of(x, y):
        with torch.autocast("cpu", torch.bfloat16) if variant.startswith("bf16") else contextlib.nullcontext():
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    batches, t0 = TokenBatches(train, 32, 128, seed=1337), time.time()
    for step in range(steps):
        loss = loss_of(*next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(variant, step, round(loss.item(), 4), f"{time.time() - t0:.0f}s", flush=True)
    with torch.no_grad():
        held = [loss_of(x, y).item() for x, y in eval_batches(val, 8, 32, 128)]
    print("FINAL", variant, steps, sum(held) / len(held), flush=True)
    return sum(held) / len(held)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 3e-3)
