"""Activation bytes per rank of one GPT block: one process, tensor parallel, tensor + sequence parallel.

    python benchmarks/sequence_parallel_memory.py --out benchmarks/results/sequence_parallel_memory.json

On gloo ranks (world 2 and 4) each rank runs the forward of its shard of :class:`examples.gpt.model.Block`
(the split rule of ``examples/gpt/tensor_parallel.py``) in training mode, dropout on, and counts the bytes
autograd saves for backward (:class:`whale.memory.block_activations.SavedActivations`: each storage once,
parameters excluded); rank 0 also measures the whole block in one process. Each measurement is set against
:func:`whale.memory.block_activations.gpt_block_activation_bytes` (Korthikanti et al. 2022, adjusted to this
block in fp32; the paper's fp16 numbers are reported beside), with ``ratio = measured / formula``. Every
rank's sequence-parallel output, put together, must equal the one-process output (same dropout masks), and a
backward runs after each measurement. Bytes are exact counts, not timings; the wall time is the host's
(shared, loaded).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]  # run as a script from anywhere

from _launch import launch  # noqa: E402
from _provenance import Run  # noqa: E402

from examples.gpt.model import Block, GPTConfig  # noqa: E402
from examples.gpt.tensor_parallel import shard_block  # noqa: E402
from whale.memory.block_activations import (  # noqa: E402
    SavedActivations,
    gpt_block_activation_bytes,
    paper_activation_bytes,
)
from whale.parallel.seqpar_ops import gather_seq  # noqa: E402

SHAPE = {"s": 64, "b": 4, "h": 64, "a": 4}
"""Sequence length, rows, hidden size, heads of the measured block."""


def _measured(module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Saved bytes of ``module(x)`` in training mode (dropout on the seed-7 stream), and the output; runs the
    backward too (collective for a shard: every rank calls it)."""
    torch.manual_seed(7)
    with SavedActivations(module) as saved:
        y = module(x)
    y.sum().backward()
    return saved.bytes, y.detach()


def measure(rank: int, world: int, shape: dict) -> dict:
    """One rank: bytes of its tensor-parallel and sequence-parallel shards (rank 0 also the whole block)."""
    s, b, h, a = shape["s"], shape["b"], shape["h"], shape["a"]
    torch.manual_seed(0)
    block = Block(GPTConfig(vocab_size=64, block_size=s, n_layer=1, n_head=a, n_embd=h, dropout=0.1,
                            attn_dropout=0.0)).train()
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1))
    out: dict = {}
    if rank == 0:
        out["one_process"], full = _measured(block, x.clone().requires_grad_())
    out["tensor_parallel"], _ = _measured(shard_block(block, None).train(), x.clone().requires_grad_())
    shard = x[:, rank * s // world:(rank + 1) * s // world].clone().requires_grad_()
    out["sequence_parallel"], y = _measured(shard_block(block, None, sequence_parallel=True).train(), shard)
    whole = gather_seq(y)
    if rank == 0:
        out["outputs_match"] = bool(torch.allclose(whole, full, rtol=1e-5, atol=1e-6))
    dist.barrier()
    return out


def report(world: int, results: list[dict], shape: dict) -> dict:
    """Measured bytes per rank against the formulas, for one world size."""
    args = (shape["s"], shape["b"], shape["h"], shape["a"])
    rows = {}
    for kind, t, sp in (("one_process", 1, False), ("tensor_parallel", world, False),
                        ("sequence_parallel", world, True)):
        measured = [r[kind] for r in results if kind in r]
        formula = gpt_block_activation_bytes(*args, t=t, sequence_parallel=sp)
        rows[kind] = {"measured_bytes_per_rank": measured, "formula_bytes": formula,
                      "ratio": [round(m / formula, 4) for m in measured],
                      "paper_fp16_bytes": paper_activation_bytes(*args, t=t, sequence_parallel=sp)}
    one = rows["one_process"]["measured_bytes_per_rank"][0]
    sp_max = max(rows["sequence_parallel"]["measured_bytes_per_rank"])
    return {"world": world, **rows, "outputs_match": results[0]["outputs_match"],
            "one_process_over_sequence_parallel": round(one / sp_max, 4),
            "within_10pct_of_formula_over_t": abs(sp_max / (one / world) - 1) <= 0.10
            and all(abs(r - 1) <= 0.10 for r in rows["sequence_parallel"]["ratio"])}


def main() -> None:
    """Measure at world 2 and 4; print and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2,4", help="comma list of split degrees")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args()
    run, start = Run(), time.perf_counter()
    cases = [report(w, launch(measure, w, SHAPE, timeout=600), SHAPE) for w in (int(v) for v in args.worlds.split(","))]
    result = {"block": "examples.gpt.model.Block (fp32, dropout 0.1 after each projection, attention dropout 0)",
              "shape": SHAPE, "cases": cases, "wall_time_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result, indent=2))
    if args.out:
        run.write(args.out, result)


if __name__ == "__main__":
    main()
