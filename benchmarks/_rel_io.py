"""Checkpoint save and load speed per GB and the busiest rank's share of the bytes (issue 24, item 7), for
benchmarks/reliability.py: ``run(tmp) -> dict``.

A 24-layer MLP of width 1024 (25.2M parameters; with AdamW's two moments the checkpoint is ~303 MB) trains one
step and is saved and loaded under data parallelism and data parallelism x pipeline at 2 and 4 gloo ranks on
this host's CPUs: ``dp2`` and ``pp2`` (two stages of one lane) at 2 ranks, ``dp4`` and ``dp2pp2`` at 4.

- ``save_gb_per_s``: the checkpoint's bytes (every file, from its manifest) / the seconds of
  ``engine.save_checkpoint`` on rank 0 (a collective that ends with a barrier: gathers, every rank's writes
  with their fsync, the manifest, the publication);
- ``load_gb_per_s``: the same bytes / the seconds until every rank has loaded (each rank reads what its stage
  needs: under data parallelism every rank reads the whole checkpoint, so the host reads world x the bytes).
  Before each load the checkpoint's pages are evicted from the page cache with ``posix_fadvise(DONTNEED)`` (the
  files were fsynced, so their pages are clean); the kernel may keep some (advisory; and on tmpfs the pages are
  the files), so load speeds can still be optimistic;
- ``busiest_rank_bytes_share``: the largest share of the checkpoint's bytes one rank wrote (manifest ``rank``
  of every file), against ``goal_share`` = 1.5 / ranks.

Each world's number is its worse layout's (lowest speed, highest share); ``layouts`` holds each one's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH, LAYERS = 1024, 24
LAYOUTS = {"2": ["dp2", "pp2"], "4": ["dp4", "dp2pp2"]}


def _model(layout: str):
    """[B, WIDTH] -> [B, WIDTH] logits; ``pp2``/``dp2pp2``: two stages of 1/2 lanes (Whale annotations)."""
    import torch
    from torch import nn

    import whale as wh

    torch.manual_seed(0)
    width = {"pp2": 1, "dp2pp2": 2}.get(layout)
    layers = []
    for _ in range(2 if width else 1):
        with wh.replicate(width) if width else _nothing():
            layers += [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS // (2 if width else 1))]
    return nn.Sequential(*layers)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _evict(ckpt: Path) -> None:
    """Drop the checkpoint's (clean, fsynced) pages from the page cache (advisory)."""
    for f in ckpt.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure(rank, world, layout, root):
    """One step, a timed save, a timed load (rank 0's seconds; both collectives end with every rank done)."""
    import torch
    import torch.distributed as dist

    import whale as wh

    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    model = _model(layout)
    engine = wh.parallelize(model, wh.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx=ctx)
    g = torch.Generator().manual_seed(1)
    engine.step((torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)))
    dist.barrier()
    start = time.perf_counter()
    path = engine.save_checkpoint(root)
    save_s = time.perf_counter() - start
    if rank == 0:
        _evict(Path(path))
    dist.barrier()
    start = time.perf_counter()
    engine.load_checkpoint(root)
    dist.barrier()
    return {"save_s": save_s, "load_s": time.perf_counter() - start, "path": path}


def _one(tmp: Path, layout: str, world: int) -> dict:
    from tests.distributed import run_ranks

    [r0, *_] = run_ranks(_measure, world, layout, str(tmp / layout), timeout=400)
    files = json.loads((Path(r0["path"]) / "whale.json").read_text())["files"]
    per: dict[int, int] = {}
    for name, e in files.items():  # the writer (a whale-dcp-1 manifest has none: DCP names files __<rank>_<i>)
        rank = e.get("rank", int(name[2:].split("_")[0]) if name.startswith("__") else 0)
        per[rank] = per.get(rank, 0) + e["bytes"]
    total = sum(per.values())
    return {"checkpoint_gb": round(total / 1e9, 3), "save_gb_per_s": round(total / 1e9 / r0["save_s"], 3),
            "load_gb_per_s": round(total / 1e9 / r0["load_s"], 3),
            "busiest_rank_bytes_share": round(max(per.values()) / total, 4),
            "bytes_per_rank": [per.get(r, 0) for r in range(world)]}


def run(tmp: Path) -> dict:
    """Measure every layout of :data:`LAYOUTS` under ``tmp``; returns the numbers described above."""
    sys.path.insert(0, str(ROOT))
    layouts = {name: _one(Path(tmp), name, int(w)) for w, names in LAYOUTS.items() for name in names}
    per_world = {w: [layouts[n] for n in names] for w, names in LAYOUTS.items()}

    def worst(key, pick):
        return {w: pick(x[key] for x in v) for w, v in per_world.items()}

    return {"save_gb_per_s": worst("save_gb_per_s", min), "load_gb_per_s": worst("load_gb_per_s", min),
            "busiest_rank_bytes_share": worst("busiest_rank_bytes_share", max),
            "goal_share": {w: round(1.5 / int(w), 4) for w in LAYOUTS},
            "layouts": layouts,
            "page_cache": "checkpoint pages evicted with posix_fadvise(DONTNEED) before each load (advisory)"}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run(Path(d)), indent=1))
