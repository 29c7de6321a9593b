"""The simulator part of benchmarks/planner.py: measured vs predicted step time of emulated runs.

Every run trains a small model for a few steps on emulated ranks (CPU ranks imitating V100/P100; the compute
is stretched to the declared speeds, the communication is real gloo on localhost) and takes the median over
steps of the slowest rank's step time; the prediction is :func:`whale.calibration.predict.predict_model` of the
same plan with this machine's calibration (unit types timed once, cached; local gloo costs measured once; the
engine fit of :mod:`whale.calibration.engine` from the machine's calibration model and from each model's
own 2-rank data-parallel runs, never from these runs).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

CLUSTERS = {2: "benchmarks/clusters/v100_p100_2.yaml", 4: "examples/clusters/v100_p100.yaml",
            "v100x4": "benchmarks/clusters/v100_4.yaml", "mixed4": "benchmarks/clusters/v100_p100_4.yaml"}
MODEL = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 512, "seq_len": 32}
BATCH = 16

# name: (world, model, stages, micro-batches, schedule, cluster key)
RUNS = {
    "dp2_m1": (2, "gpt", 1, 1, "1F1B", 2),
    "dp2_m4": (2, "gpt", 1, 4, "1F1B", 2),
    "pp2_m1": (2, "gpt", 2, 1, "1F1B", 2),
    "pp2_m4": (2, "gpt", 2, 4, "1F1B", 2),
    "pp2_m8_gpipe": (2, "gpt", 2, 8, "GPipe", 2),
    "split2_m2": (2, "split", 1, 2, "1F1B", 2),
    "dp4_m2": (4, "gpt", 1, 2, "1F1B", "mixed4"),
    "pp4_m4": (4, "gpt", 4, 4, "1F1B", "mixed4"),
    "pp4_m8": (4, "gpt", 4, 8, "1F1B", "v100x4"),
    "pp2xdp2_m2": (4, "gpt", 2, 2, "1F1B", 4),
    "pp2xdp2_m4": (4, "gpt", 2, 4, "1F1B", 4),
    "pp2xdp2_m8_gpipe": (4, "gpt", 2, 8, "GPipe", 4),
    "split_pp2xdp2_m2": (4, "split", 2, 2, "1F1B", 4),
}


class SplitNet(nn.Module):
    """Embedding, a block, an MLP split over the lanes (column then row), a block and a head; one stage of width
    ``width`` (``stages=1``) or two stages of width ``width`` (the split in the second). [B, T] -> [B, T, V]."""

    def __init__(self, width: int, stages: int, vocab: int = 512, d: int = 64):
        super().__init__()
        import whale as wh
        from tests.models import Block

        with wh.replicate(width):
            self.emb = nn.Embedding(vocab, d)
            self.block0 = Block(d)
            if stages == 1:
                self._tail(wh, width, vocab, d, Block)
        if stages == 2:
            with wh.replicate(width):
                self._tail(wh, width, vocab, d, Block)

    def _tail(self, wh, width, vocab, d, block) -> None:
        with wh.split(width):
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.block1 = block(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.block0(self.emb(idx))
        x = x + self.mlp(x)
        return self.head(self.block1(x))


def build(name: str, world: int):
    """``(model, sample batch, loss)`` of a run (same weights for a name)."""
    from examples.gpt.model import for_plan
    from whale.loss import token_cross_entropy

    _, kind, stages, _, _, _ = RUNS[name]
    torch.manual_seed(0)
    if kind == "gpt":
        return for_plan(**MODEL, stages=stages, batch=BATCH)
    x = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_len"]))
    width = world // stages
    return SplitNet(width, stages, MODEL["vocab_size"], MODEL["n_embd"]), (x, x), token_cross_entropy()


def _measure(eng, batch, warmup: int, steps: int) -> dict:
    """Median (over steps) of the slowest rank's step time, and this rank's median F/B segment seconds."""
    x = torch.randint(0, MODEL["vocab_size"], batch[0].shape, generator=torch.Generator().manual_seed(1))
    times, fwd, bwd = [], [], []
    for i in range(warmup + steps):
        dist.barrier()
        r = eng.step((x, x))
        t = torch.tensor([r["step_time"], r["schedule_time"]])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(t.tolist())
            fwd += [c1 - c0 for label, _, c0, c1 in eng.last_timeline if label[0] == "F"]
            bwd += [c1 - c0 for label, _, c0, c1 in eng.last_timeline if label[0] == "B"]
    return {"step_s": statistics.median(t[0] for t in times), "schedule_s": statistics.median(t[1] for t in times),
            "fwd_s": statistics.median(fwd) if fwd else 0.0, "bwd_s": statistics.median(bwd) if bwd else 0.0,
            "stage": eng.stage, "lane": eng.lane, "slowdown": eng.slowdown}


def worker(rank: int, world: int, cfg: dict) -> dict:
    """Every run of this world size: build, train ``warmup + steps`` steps, measure (rank 0 returns the plans)."""
    import whale as wh

    out = {}
    for name in cfg["runs"]:
        w, _, _, m, schedule, ckey = RUNS[name]
        if w != world:
            continue
        model, batch, loss = build(name, world)
        ctx = wh.init(wh.Config(num_micro_batch=m, schedule=schedule, seed=0, cluster=CLUSTERS[ckey],
                                track_memory=cfg.get("track_memory")))
        eng = wh.parallelize(model, loss, lambda ps: torch.optim.AdamW(ps, lr=1e-4), ctx=ctx)
        got = _measure(eng, batch, cfg["warmup"], cfg["steps"])
        every = [None] * world
        dist.all_gather_object(every, got)
        out[name] = {"plan": eng.plan.to_json(), "ranks": every}
    return out


def predict_run(name: str, plan_json: str, cores: float, factors: list[float]) -> tuple[dict, dict]:
    """The predictions for one run's plan (in this process; calibration cached) with the ranks' actual
    emulation stretch ``factors`` (``1 + slowdown``) and with the nominal one."""
    from whale.calibration.predict import measured_costs
    from whale.cluster import ClusterSpec
    from whale.frontend.hwplan import sample_rows
    from whale.plan.plan import Plan
    from whale.planner.steptime.simulate import predict

    world, *_, ckey = RUNS[name]
    model, batch, loss = build(name, world)
    plan = Plan.from_json(plan_json)
    costs, mems, calib = measured_costs(model, plan, batch, loss)
    cluster, rows = ClusterSpec.from_yaml(CLUSTERS[ckey]), sample_rows(batch)
    return tuple(predict(plan, costs, cluster, calib, rows, mems, cores, f).to_dict() for f in (factors, None))


def simulator_part(launch, runs: list[str], warmup: int = 3, steps: int = 8, cores: float = 0.25) -> dict:
    """Measure every run (one launch per world size), predict each, and summarise the errors."""
    from whale.plan.plan import Plan

    os.environ["WHALE_EMULATION_CORES"] = str(cores)
    t0 = time.time()
    measured = {}
    for world in sorted({RUNS[n][0] for n in runs}):
        for per_rank in [launch(worker, world, {"runs": runs, "warmup": warmup, "steps": steps,
                                                   "track_memory": False})]:
            measured.update(per_rank[0])
    t_measure = time.time() - t0
    table = []
    for name in runs:
        ranks = measured[name]["ranks"]
        plan = Plan.from_json(measured[name]["plan"])
        actual = [0.0] * len(ranks)
        for r in ranks:
            actual[plan.rank_of(r["stage"], r["lane"])] = 1.0 + r["slowdown"]
        pred, nominal = predict_run(name, measured[name]["plan"], cores, actual)
        meas = ranks[0]["step_s"]
        table.append({"run": name, "world": RUNS[name][0], "model": RUNS[name][1], "stages": RUNS[name][2],
                      "micro_batches": RUNS[name][3], "schedule": RUNS[name][4], "cluster": CLUSTERS[RUNS[name][5]],
                      "measured_step_s": meas, "predicted_step_s": pred["step_s"],
                      "rel_error": (pred["step_s"] - meas) / meas, "emulation_factors": actual,
                      "nominal_predicted_step_s": nominal["step_s"],
                      "nominal_rel_error": (nominal["step_s"] - meas) / meas,
                      "measured_schedule_s": ranks[0]["schedule_s"], "predicted_schedule_s": pred["schedule_s"],
                      "measured_fwd_s_by_rank": [r["fwd_s"] for r in ranks],
                      "measured_bwd_s_by_rank": [r["bwd_s"] for r in ranks],
                      "predicted_stage_fwd_s": pred["stage_fwd_s"], "predicted_stage_bwd_s": pred["stage_bwd_s"],
                      "predicted_comm_s": pred["comm_s"], "predicted_peak_bytes": pred["peak_bytes"]})
    errs = sorted(abs(r["rel_error"]) for r in table)
    nominal = sorted(abs(r["nominal_rel_error"]) for r in table)
    return {"sim_median_abs_rel_error": statistics.median(errs), "sim_max_abs_rel_error": max(errs),
            "sim_nominal_median_abs_rel_error": statistics.median(nominal),
            "sim_nominal_max_abs_rel_error": max(nominal),
            "sim_runs": table, "sim_setup": {"model": MODEL, "global_batch": BATCH, "warmup": warmup, "steps": steps,
                                             "emulation_cores": cores, "measure_s": t_measure,
                                             "predict_s": time.time() - t0 - t_measure,
                                             "note": "EMULATED: CPU ranks imitate the declared GPUs; communication "
                                                     "is real gloo on localhost, predicted with calibrated local "
                                                     "gloo latency/bandwidth"}}


def plot_sim(table: list[dict], path: str) -> None:
    """Predicted vs measured step time, one point per run, with the +-10% and +-20% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    xs = [r["measured_step_s"] for r in table]
    ys = [r["predicted_step_s"] for r in table]
    top = max(xs + ys) * 1.15
    ax.plot([0, top], [0, top], "k-", lw=1, label="exact")
    for f, style in ((0.1, "--"), (0.2, ":")):
        ax.plot([0, top], [0, top * (1 + f)], "g" + style, lw=0.8, label=f"+-{f:.0%}")
        ax.plot([0, top], [0, top * (1 - f)], "g" + style, lw=0.8)
    ax.scatter(xs, ys, c="C0")
    for r, x, y in zip(table, xs, ys, strict=True):
        ax.annotate(r["run"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time, s (median, slowest rank)")
    ax.set_ylabel("predicted step time, s (whale simulator)")
    ax.set_title("Step time: simulator vs measured (EMULATED V100/P100 on CPU)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_sim(part: dict) -> None:
    """The per-run table."""
    print(f"{'run':>18} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for r in part["sim_runs"]:
        print(f"{r['run']:>18} {r['measured_step_s']:>10.4f} {r['predicted_step_s']:>11.4f} {r['rel_error']:>+7.1%}")
    print(f"median |error| {part['sim_median_abs_rel_error']:.3f} (goal <= 0.10), "
          f"max {part['sim_max_abs_rel_error']:.3f} (goal <= 0.20)", flush=True)


def run(args) -> dict:
    """The sim part for :mod:`benchmarks.planner`: measure and predict, print the table, write the PNG."""
    from benchmarks._launch import launch

    t0 = time.time()
    before = os.environ.get("WHALE_EMULATION_CORES")
    try:
        part = simulator_part(launch, args.runs.split(","), args.warmup, args.steps, args.cores)
    finally:  # the stretched emulation is this part's own; later parts run at the machine's cores
        if before is None:
            os.environ.pop("WHALE_EMULATION_CORES", None)
        else:
            os.environ["WHALE_EMULATION_CORES"] = before
    png = os.path.splitext(args.out)[0] + "_sim.png"
    plot_sim(part["sim_runs"], png)
    print_sim(part)
    return {**part, "sim_png": png, "sim_wall_s": time.time() - t0}
