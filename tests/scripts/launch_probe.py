"""Probe run by ``whale launch`` in tests/test_launch.py.

Usage: ``launch_probe.py OUT_DIR [extra args...]``. Each worker joins a gloo process group, all-reduces
``rank + 1`` and writes ``OUT_DIR/rank{RANK}.json`` with the sum, its world size, the extra arguments it
received verbatim and the ``WHALE_CLUSTER`` / ``OMP_NUM_THREADS`` it saw; it also prints one line.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    """Join the group, all-reduce, report."""
    out_dir, extra = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world": world,
        "sum": value.item(),
        "args": extra,
        "whale_cluster": os.environ.get("WHALE_CLUSTER"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    print(f"launch_probe rank={rank} world={world} sum={value.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
