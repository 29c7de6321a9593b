"""The GPT job's end-of-run reports (rank 0 prints, every rank takes part where a line says collective): the
per-stage bubble against the schedule's theory, optimizer and gradient bytes per rank, the generated sample, the
result lines and the JSON summary. Split from examples/gpt/train.py, which trains."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import whale as wh
from examples.gpt.data import load_tokenizer
from examples.gpt.model import GPT, GPTConfig
from whale.parallel.zero import held_gradient_bytes, state_bytes
from whale.plan.schedule import schedule_bubble


def bubble_report(engine: wh.Engine, args: argparse.Namespace) -> list[dict]:
    """Per stage: busy and idle share of the step (recent steps) vs the 1F1B/GPipe theory (collective)."""
    stats = engine.stage_stats()
    p, m, v = engine.plan.num_stages, engine.plan.num_micro_batch, engine.plan.virtual_stages
    theory = schedule_bubble(engine.plan.schedule, p, m, v)
    rows = [dict(stage=s["stage"], busy_s=s["busy"], step_s=s["step"], busy_share=s["busy"] / s["step"],
                 idle_share=1 - s["busy"] / s["step"], theory_idle=theory) for s in stats if s["step"]]
    if engine.rank == 0:
        chunks = f" x {v} chunks" if v > 1 else ""
        print(f"\nbubble report: {p} stage(s){chunks}, {m} micro-batch(es), {args.schedule}; "
              f"theory idle (whale.plan.schedule.schedule_bubble) = {theory:.3f}")
        print(" stage  busy s/step  step s  busy share  idle share  theory idle")
        for r in rows:
            print(f" {r['stage']:>5}  {r['busy_s']:>11.3f}  {r['step_s']:>6.3f}  {r['busy_share']:>10.1%}"
                  f"  {r['idle_share']:>10.1%}  {r['theory_idle']:>11.1%}")
        print(" (step = the forward/backward schedule alone, without gradient sync and optimizer; busy = this "
              "stage's compute; idle = bubble + stage-to-stage transfers. Ranks that outnumber the CPU cores "
              "contend for them, which inflates busy time; benchmarks/pipeline_bubble.py measures the bubble "
              "with one rank per core)")
    return rows


def sample(cfg: GPTConfig, full_state: dict, args: argparse.Namespace) -> str:
    """Rank 0: load the gathered weights into a plain GPT and generate text after ``--prompt``."""
    model = GPT(cfg)  # one process: an MoE model's experts all here (its wh.split only annotates)
    model.load_state_dict(full_state)
    tok = load_tokenizer(args.data_dir)
    idx = torch.tensor([tok.encode(args.prompt).ids], dtype=torch.long)  # [1, T0]
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        out = model.generate(idx, args.sample_tokens, temperature=0.8, top_k=50)
    return tok.decode(out[0].tolist())


def optimizer_state_bytes(engine: wh.Engine) -> list[int]:
    """Bytes of every rank's optimizer state tensors (AdamW's moments), by rank (collective); rank 0 also prints
    the gradient bytes each rank holds between steps."""
    mine = [state_bytes(engine.optimizer), held_gradient_bytes(engine.grad_sync)]
    out: list = [mine]
    if dist.is_initialized():
        out = [None] * engine.world_size
        dist.all_gather_object(out, mine)
    if engine.rank == 0:
        for i, what in enumerate(("optimizer state", "gradients held between steps")):
            where = " in host memory" if engine.plan.offload != "none" and i == 0 else ""
            print(f"{what}{where} per rank (ZeRO-{engine.plan.zero}): "
                  + ", ".join(f"rank {r}: {b[i] / 2**20:.2f} MiB" for r, b in enumerate(out)), flush=True)
    return [b[0] for b in out]


def finish(args, cfg, engine, full, state, bubble, wall_s: float) -> None:
    """Rank 0: print the result lines and the sample; write the JSON summary."""
    final = state["val"][-1][1] if state["val"] else state["val0"]
    drop = state["val0"] - final
    tok_s = state["train_tokens"] / max(state["train_time"], 1e-9)
    print(f"\nheld-out loss: initial {state['val0']:.4f} -> final {final:.4f} (drop {drop:.3f} nats)")
    print(f"throughput {tok_s:,.0f} tokens/s; wall time {wall_s:.1f} s; checkpoint in {args.ckpt_dir}")
    if "loss_scale" in state:
        print(f"fp16: final loss scale {state['loss_scale']:g}, {state['skipped_steps']} step(s) skipped on overflow")
    text = sample(cfg, full, args) if args.sample_tokens else ""
    if text:
        print("\n--- sample ---\n" + text + "\n--------------")
    summary = dict(
        initial_val_loss=state["val0"], final_val_loss=final, val_loss_drop=drop, val_curve=state["val"],
        train_loss=state["train_loss"],
        tokens_per_s=tok_s, train_time_s=state["train_time"], wall_time_s=wall_s, steps=state["steps_done"],
        world_size=engine.world_size, stages=engine.plan.num_stages, micro_batches=engine.plan.num_micro_batch,
        schedule=args.schedule, precision=args.precision, skipped_steps=state.get("skipped_steps", 0),
        bubble=bubble, config=vars(args), sample=text, memory=state["memory"], zero=engine.plan.zero,
        offload=engine.plan.offload, optimizer_state_bytes_per_rank=state["optimizer_state_bytes"],
        predicted=state.get("predicted"), run=engine.run_id, adaptive=state.get("adaptive"),
    )
    os.makedirs(os.path.dirname(args.summary) or ".", exist_ok=True)
    with open(args.summary, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"summary written to {args.summary}")
