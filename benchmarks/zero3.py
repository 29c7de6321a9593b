"""Whale's ZeRO-3 (:mod:`whale.parallel.zero3`) beside FSDP2 (``torch.distributed.fsdp.fully_shard``) on the
same model, ranks and data: throughput and measured peak memory.

Four plain CPU gloo ranks (no emulation: equal shares, so FSDP2's even ``Shard(0)`` cut is the same split)
train the GPT of ``examples/gpt/model.py`` (tied embedding/head, AdamW) in one process group, once under Whale
(``Config(zero=3)``: one unit per block, the rest in the root unit) and once under FSDP2 (``fully_shard`` on
every block, then on the root), built from one ``deepcopy`` and fed the same batches (each rank its quarter
of every global batch). The two run in paired rounds of a few steps each (:mod:`benchmarks._paired`: ABBA
order, a warm-up round discarded); the step time of a round is the slowest rank's mean; the reported
``zero3_vs_fsdp2_throughput`` is the median over rounds of FSDP2's step time over Whale's in the same round
(Whale's throughput over FSDP2's), with its IQR in ``zero3_vs_fsdp2_throughput_paired``. (Before pairing, the
ratio of the two medians of unpaired alternating rounds read 1.238: in 10 of 10 rounds the system that ran
first was faster.)

Peak memory is measured the same way for both, never estimated: a :class:`whale.memory.tracker.StorageTracker`
counts the persistent state (each optimizer's parameters, gradients and state; module parameters) plus every
storage made during a step, and ``UntypedStorage.resize_`` is wrapped while measuring so that the frees and
re-allocations of gathered parameters (both systems resize storage in place) are counted. The ratio is the
largest rank peak of Whale over FSDP2's. The first losses of both are compared as a check of "same job".

    python benchmarks/zero3.py --out benchmarks/results/zero3.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._launch import launch  # noqa: E402
from benchmarks._paired import describe, rounds, summary  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402


@contextlib.contextmanager
def _measured(tracker, tensors):
    """``tracker`` on, the persistent ``tensors`` (``(tensor, category)``) counted, storage resizes seen."""
    import torch

    for t, cat in tensors:
        tracker.label(t, cat)
    tracker.reset_peak()
    original = torch.UntypedStorage.resize_

    def resize(storage, nbytes):
        """``UntypedStorage.resize_``, then told to the tracker."""
        out = original(storage, nbytes)
        tracker.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize
    try:
        with tracker:
            yield
    finally:
        torch.UntypedStorage.resize_ = original


def _state(optimizer, module):
    """The persistent tensors of a job: module and optimizer parameters, their gradients, optimizer state."""
    import torch

    def local(t):
        """A DTensor's local shard, else the tensor."""
        return t.to_local() if hasattr(t, "to_local") else t

    params = [*module.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    out = [(local(p), "parameters") for p in params]
    out += [(local(p.grad), "gradients") for p in params if p.grad is not None]
    out += [(local(v), "optimizer_state") for st in optimizer.state.values() for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim()]
    return out


def _jobs(cfg):
    """The Whale engine and the FSDP2 model + optimizer, from one initialisation, and the batches."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig

    ctx = wh.init(wh.Config(zero=3, track_memory=False, seed=0))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4,
                          n_embd=cfg["embd"]))
    twin = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.token_cross_entropy(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    for block in twin.blocks:
        fully_shard(block)
    fully_shard(twin)
    fsdp_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = cfg["batch"] // world

    def fsdp_step(batch):
        """One FSDP2 step on this rank's rows; returns the global mean loss (all-reduced, as Whale does)."""
        x, y = (t[rank * rows:(rank + 1) * rows] for t in batch)
        fsdp_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(twin(x).flatten(0, 1), y.flatten())
        loss.backward()
        fsdp_opt.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / world

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(4)]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    return engine, (lambda b: engine.step(b)["loss"]), twin, fsdp_opt, fsdp_step, batches


def _worker(rank, world, cfg):
    """Both jobs in this process group: losses, alternating timed rounds, then measured peaks."""
    import torch.distributed as dist

    from whale.memory.tracker import StorageTracker

    engine, whale_step, twin, fsdp_opt, fsdp_step, batches = _jobs(cfg)
    steps = {"whale": whale_step, "fsdp2": fsdp_step}
    losses = {name: [fn(b) for b in batches[:2]] for name, fn in steps.items()}  # also the warm-up

    def timer(name):
        """Seconds per step of ``cfg["steps"]`` steps of one system, from a barrier."""
        def run():
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(cfg["steps"]):
                steps[name](batches[i % len(batches)])
            return (time.perf_counter() - t0) / cfg["steps"]
        return run

    whale_s, fsdp_s = rounds(timer("whale"), timer("fsdp2"), cfg["rounds"], warmup=1)
    times = {"whale": whale_s, "fsdp2": fsdp_s}
    peaks, at_peak = {}, {}
    for name, (opt, module) in {"whale": (engine.optimizer, engine.module), "fsdp2": (fsdp_opt, twin)}.items():
        tracker = StorageTracker()
        if name == "whale":
            engine.zero.tracker = tracker
        dist.barrier()
        with _measured(tracker, _state(opt, module)):
            for b in batches[:2]:
                steps[name](b)
        peaks[name], at_peak[name] = tracker.peak, dict(tracker.at_peak)
    return {"losses": losses, "times": times, "peaks": peaks, "at_peak": at_peak,
            "units": [u.name for u in engine.zero.units],
            "shard_elements": sum(pc.param.numel() for pc in engine.zero.pieces)}


def main() -> None:
    """Run both jobs side by side, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=10, help="measured paired rounds (ABBA order)")
    args = p.parse_args()
    run = Run()
    cfg = {k: getattr(args, k) for k in ("layers", "embd", "vocab", "seq", "batch", "steps", "rounds")}
    t0 = time.time()
    res = launch(_worker, 4, cfg)
    wall = time.time() - t0
    per_round = {n: [max(r["times"][n][i] for r in res) for i in range(cfg["rounds"])] for n in ("whale", "fsdp2")}
    med = {n: statistics.median(v) for n, v in per_round.items()}
    peak = {n: max(r["peaks"][n] for r in res) for n in ("whale", "fsdp2")}
    loss_gap = max(abs(a - b) for a, b in zip(res[0]["losses"]["whale"], res[0]["losses"]["fsdp2"], strict=True))
    paired = summary(per_round["whale"], per_round["fsdp2"], goal=0.95, names=("whale", "fsdp2"))
    out = {"zero3_vs_fsdp2_throughput": paired["median"], "zero3_vs_fsdp2_throughput_paired": paired,
           "zero3_vs_fsdp2_throughput_goal_met": paired["goal_met"],
           "ratio_of_medians_unpaired": med["fsdp2"] / med["whale"],
           "zero3_vs_fsdp2_peak_memory": peak["whale"] / peak["fsdp2"],
           "goals": {"zero3_vs_fsdp2_throughput": ">= 0.95", "zero3_vs_fsdp2_peak_memory": "<= 1.05"},
           "median_step_s": med, "step_s_per_round": per_round, "peak_bytes_max_rank": peak,
           "per_rank": [{"rank": i, "peak_bytes": r["peaks"], "bytes_at_peak": r["at_peak"],
                         "whale_shard_elements": r["shard_elements"]} for i, r in enumerate(res)],
           "first_losses": res[0]["losses"], "first_loss_max_abs_gap": loss_gap,
           "whale_units": res[0]["units"], "model": {k: cfg[k] for k in ("layers", "embd", "vocab", "seq")},
           "global_batch": cfg["batch"], "world_size": 4, "timed": f"{cfg['rounds']} ABBA-paired rounds x "
           f"{cfg['steps']} steps per system, 1 warm-up round discarded",
           "where": "plain CPU gloo ranks (1 thread each), no emulation",
           "wall_s": wall}
    print(f"{'':8}{'median step s':>15}{'peak MiB (max rank)':>22}")
    for n in ("whale", "fsdp2"):
        print(f"{n:8}{med[n]:15.4f}{peak[n] / 2**20:22.2f}")
    print(f"zero3_vs_fsdp2_throughput (median paired) = {describe(paired)}")
    print(f"zero3_vs_fsdp2_peak_memory = {out['zero3_vs_fsdp2_peak_memory']:.3f} (goal <= 1.05)")
    print(f"first losses whale {res[0]['losses']['whale']} fsdp2 {res[0]['losses']['fsdp2']}; {wall:.0f} s")
    run.write(args.out, out)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
