"""The planner's predicted step beside the measured one, for ``make train`` (examples/gpt/train.py).

:func:`prediction_report` (collective: every rank gathers its emulation stretch) has rank 0 predict the plan's
step with :func:`whale.calibration.predict.predict_model` (this machine's calibration, cached after the first run)
and print, per stage, the measured busy seconds per step (the bubble report's) beside the predicted ones, and
the measured mean step time beside the predicted step time. Under an emulated cluster the prediction uses each
rank's actual emulation stretch (``1 + engine.slowdown``) and local gloo costs, as the run does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import whale as wh
from examples.gpt.model import GPT, GPTConfig


def add_prediction_args(a) -> None:
    """The prediction report's flag; ``a`` is ``add_argument``."""
    a("--calibrate-engine", action="store_true",
      help="at the end, rank 0 measures this machine's and this model's engine fits when not cached yet (once, "
           "about 4 min for the default model on 2 cores; other ranks wait), so the printed prediction is "
           "calibrated; later runs reuse them")


def _factors(engine: wh.Engine) -> list[float] | None:
    """Every rank's ``1 + slowdown`` under emulation (collective), by global rank; ``None`` on real hardware."""
    mine = engine.slowdown
    every = [mine]
    if dist.is_initialized():
        every = [None] * engine.world_size
        dist.all_gather_object(every, mine)
    return None if any(s is None for s in every) else [1.0 + s for s in every]


def prediction_report(engine: wh.Engine, args, bubble: list[dict], state: dict) -> dict | None:
    """Rank 0: predicted vs measured step and per-stage busy time (printed); returns the dict for the JSON
    summary (``None`` on other ranks or when the prediction fails: the run's result never depends on it)."""
    factors = _factors(engine)
    if engine.rank != 0:
        return None
    try:
        cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                        n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
        layers = [int(c) for c in args.stage_layers.split(",")] if args.stage_layers else None
        model = GPT(cfg, stages=args.stages * getattr(args, "virtual_stages", 1), stage_layers=layers)
        x = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
        from whale.calibration.predict import predict_model

        pred = predict_model(model, engine.plan, (x, x), wh.token_cross_entropy(), engine.ctx.cluster,
                             factors=factors, tracked=engine.memory.tracker is not None,
                             measure_engine=args.calibrate_engine)
    except Exception as exc:  # noqa: BLE001 - a report, not the job
        print(f"(no step-time prediction: {type(exc).__name__}: {exc})", flush=True)
        return None
    out = _print(engine, pred, bubble, state)
    missing = _missing_fit(model, x, engine.memory.tracker is not None)
    if missing:
        print(f" (no {missing} cached on this machine: the prediction uses the isolated unit timings without the "
              f"engine's scale and overheads, so it is less accurate, either way; run once with --calibrate-engine "
              f"to measure it, a few minutes, and later runs use it)", flush=True)
    return out


def _missing_fit(model, x: torch.Tensor, tracked: bool) -> str:
    """Which engine fit the cache lacks for this model (the job measures none without ``--calibrate-engine``):
    ``"engine calibration"`` (the machine's), ``"engine fit of this model"``, or ``""``."""
    from whale.frontend.unit_keys import unit_keys
    from whale.planner import calibration_cache as cal

    cached = cal.load(cal.machine_key())
    if cached is None or cached.engine is None or cached.engine.version != cal.ENGINE_VERSION:
        return "engine calibration"
    keys = unit_keys(model, (x, x), None, wh.token_cross_entropy(), tracked)
    return "" if cached.for_model(cal.model_signature(keys)) is not cached else "engine fit of this model"


def _print(engine: wh.Engine, pred, bubble: list[dict], state: dict) -> dict:
    plan = engine.plan
    steps = max(1, len(state.get("train_loss", [])))
    measured = state["train_time"] / steps
    stages = []
    for s in range(plan.num_stages):
        ranks = plan.stage_ranks(s)
        busy = sum(pred.rank_busy[r] for r in ranks) / len(ranks)
        got = next((b["busy_s"] for b in bubble if b["stage"] == s), None)
        stages.append({"stage": s, "predicted_busy_s": busy, "measured_busy_s": got,
                       "predicted_fwd_s_per_micro_batch": pred.stage_fwd[s],
                       "predicted_bwd_s_per_micro_batch": pred.stage_bwd[s]})
    where = "EMULATED: compute stretched as the run's, communication = calibrated local gloo" if pred.emulated \
        else "declared cluster"
    print(f"\nplanner prediction ({where}):")
    print(f" step time: measured {measured:.4f} s/step (mean over {steps} steps), predicted {pred.step:.4f} s "
          f"({(pred.step - measured) / measured:+.1%})")
    print(" stage  measured busy s/step  predicted busy s/step  predicted fwd / bwd s per micro-batch")
    for r in stages:
        got = f"{r['measured_busy_s']:.4f}" if r["measured_busy_s"] is not None else "-"
        print(f" {r['stage']:>5}  {got:>20}  {r['predicted_busy_s']:>21.4f}  "
              f"{r['predicted_fwd_s_per_micro_batch']:.4f} / {r['predicted_bwd_s_per_micro_batch']:.4f}")
    print(" (measured busy = the bubble report's; the first steps' warm-up is in the measured mean)", flush=True)
    return {"measured_step_s": measured, "predicted_step_s": pred.step,
            "rel_error": (pred.step - measured) / measured, "stages": stages, "prediction": pred.to_dict()}
