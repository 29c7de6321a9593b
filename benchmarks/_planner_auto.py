"""The auto plan against every enumerated plan, measured (part of :mod:`benchmarks.planner`). EMULATED.

On 4 emulated ranks (``benchmarks/clusters/v100_p100_4.yaml``: 2 V100-32GB + 2 P100-16GB, each CPU rank slowed
to its device's relative fp32 speed) a small GPT (``examples/gpt/model.py``) runs every plan a user could
write by hand with Whale's annotations: 4-way data parallel (1, 2 or 4 micro-batches of gradient accumulation),
2 pipeline stages x 2 replicas and 4 pipeline stages, each with 1, 2, 4 or 8 micro-batches under 1F1B and
GPipe, all hardware-aware (Algorithm 1 shares, speed-balanced cuts); and the plan ``Config(auto=True)``
chooses for the unannotated model, ranked by the calibrated estimator
(:class:`whale.planner.steptime.calibrated.CalibratedEstimator`: this machine's unit types are calibrated first,
cached). Every engine is built in one launch and measured round by round (interleaved, the order reversed every other
round, median seconds per step), so they share the host's load.

The best enumerated plan (least median step time in that sweep) is then measured against the auto plan in
paired rounds (:mod:`benchmarks._paired`: ABBA order, a warm-up round discarded): ``auto_vs_best_enumerated``
= the median over rounds of the best plan's step time / the auto plan's in the same round (goal >= 0.95), its
IQR and ``goal_met`` (``"unclear"`` when the IQR straddles 0.95) in ``auto_vs_best_enumerated_paired``.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._hetero_common import emulation_setup, interleave, load_spec, timed_steps
from benchmarks._launch import launch
from benchmarks._paired import describe, rounds, summary

SPEC = "v100_p100_4.yaml"


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _plans() -> list[tuple[str, int, int, str]]:
    """(name, pipeline stages, micro-batches, schedule) of every enumerated plan."""
    out = [(f"dp4 m{m}", 1, m, "1F1B") for m in (1, 2, 4)]
    for stages in (2, 4):
        for m in (1, 2, 4, 8):
            for sched in ("1F1B", "GPipe"):
                out.append((f"pp{stages}x dp{4 // stages} m{m} {sched}", stages, m, sched))
    return out


def _engines(cfg: dict, spec, batch) -> dict:
    import whale as wh
    from examples.gpt.model import GPT, GPTConfig

    gcfg = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4,
                     n_embd=cfg["embd"])
    engines = {}
    for name, stages, m, sched in _plans():
        ctx = wh.init(wh.Config(cluster=spec, num_micro_batch=m, schedule=sched, seed=0))
        engines[name] = wh.parallelize(GPT(gcfg, stages=stages), _loss, _opt, ctx=ctx, sample_batch=batch)
    ctx = wh.init(wh.Config(cluster=spec, seed=0, auto=True))
    engines["auto"] = wh.parallelize(GPT(gcfg, stages=1), _loss, _opt, ctx=ctx, sample_batch=batch)
    return engines


def worker(rank: int, world: int, cfg: dict) -> dict | None:
    """Build every engine, measure them round by round; rank 0 returns medians and plans."""
    emulation_setup(cfg, rank)
    spec = load_spec(SPEC)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    batch = (x, torch.roll(x, -1, 1))
    engines = _engines(cfg, spec, batch)
    times = interleave(engines, batch, cfg["warmup"], cfg["rounds"], cfg["steps"])
    choice = [min((n for n in times if n != "auto"), key=lambda n: statistics.median(times[n]))]
    dist.broadcast_object_list(choice, 0)  # rank 0's pick: every rank times the same pair
    best = choice[0]
    auto_s, best_s = rounds(lambda: timed_steps(engines["auto"], batch, cfg["steps"]),
                            lambda: timed_steps(engines[best], batch, cfg["steps"]), cfg["paired_rounds"], 1)
    if rank != 0:
        return None
    out = {name: {"step_s": statistics.median(t), "times": t, "plan_notes": list(engines[name].plan.notes)}
           for name, t in times.items()}
    return {"sweep": out, "best": best, "paired_s": {"auto": auto_s, best: best_s}}


def _calibrate(cfg: dict) -> None:
    """Calibrate this machine for the GPT's unit types (timed under the memory tracker, as emulated runs are),
    once, into the cache every rank's ``Config(auto=True)`` reads (:func:`whale.frontend.autoplan.estimator`);
    a few seconds the first time, nothing when cached."""
    from examples.gpt.model import GPT, GPTConfig
    from whale.calibration.measure import calibration

    gcfg = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4,
                     n_embd=cfg["embd"])
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(0))
    calibration(GPT(gcfg, stages=1), (x, torch.roll(x, -1, 1)), _loss, tracked=True)


def run(args) -> dict:
    """Launch the measurement on 4 ranks and summarise (see the module docstring)."""
    cfg = {"vocab": 512, "seq": 64, "layers": 4, "embd": 128, "batch": 16, "warmup": 2,
           "rounds": getattr(args, "auto_rounds", 5), "steps": 2,
           "paired_rounds": getattr(args, "auto_paired_rounds", 10)}
    _calibrate(cfg)
    got = launch(worker, 4, cfg)[0]
    res, best = got["sweep"], got["best"]
    for name, v in sorted(res.items(), key=lambda kv: kv[1]["step_s"]):
        print(f"{name:>24}: {v['step_s'] * 1e3:8.2f} ms/step", flush=True)
    paired = summary(got["paired_s"]["auto"], got["paired_s"][best], goal=0.95, names=("auto", best))
    print(f"auto_vs_best_enumerated (median paired, best enumerated: {best}) = {describe(paired)}", flush=True)
    return {"auto_vs_best_enumerated": paired["median"], "auto_vs_best_enumerated_paired": paired,
            "auto_vs_best_enumerated_goal_met": paired["goal_met"], "best_enumerated": best,
            "auto_plan": res["auto"]["plan_notes"], "measured_step_seconds": {k: v["step_s"] for k, v in res.items()},
            "setup": {**cfg, "spec": SPEC}, "emulated": True}
