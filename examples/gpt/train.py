"""Train the example GPT on Shakespeare with Whale: data parallel x pipeline, from annotations in the model.

Launch (from the repo root; ``make train`` does the first)::

    whale launch -n 4 examples/gpt/train.py                # 2 data-parallel lanes x 2 pipeline stages
    torchrun --standalone --nproc-per-node 4 examples/gpt/train.py --stages 2 --micro-batches 4
    python examples/gpt/train.py --stages 1                # one process, plain data parallel of one

The world size must be a multiple of ``--stages``; ``world / stages`` lanes of data parallelism wrap the
pipeline. Each rank reads only its own rows of every global batch ``[batch_size, seq_len]`` (``wh.local_rows``
under the plan's shares, stepped with ``engine.step_local``; a middle pipeline stage reads nothing);
``--global-batches`` gives every rank the whole batch instead and Whale slices the rows (the same training).
Rank 0 prints the plan, a progress bar, held-out losses, a generated sample, the bubble report, the measured
memory table (``--activation-checkpoint`` recomputes the blocks' activations in backward), and writes
a JSON summary. ``--resume`` continues from ``--ckpt-dir`` with the same loss trajectory as an uninterrupted
run (model, optimizer, RNG, step and data position are restored; the LR is a function of the step).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

import whale as wh  # noqa: E402
from examples.cli import Parser  # noqa: E402
from examples.gpt.adaptive import Adaptive, add_adaptive_args, ckpt_every  # noqa: E402
from examples.gpt.data import (  # noqa: E402
    DEFAULT_DATA_DIR,
    TokenBatches,
    eval_batches,
    load_tokens,
    prepare,
)
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from examples.gpt.moe import add_moe_args, model_config, moe_loss_fn  # noqa: E402
from examples.gpt.pipeline_flags import add_schedule_args, check_schedule_args  # noqa: E402
from examples.gpt.predicted import add_prediction_args, prediction_report  # noqa: E402
from examples.gpt.report import bubble_report, finish, optimizer_state_bytes  # noqa: E402
from examples.gpt.runs import (  # noqa: E402
    add_elastic_args,
    add_resume_args,
    claim_fresh,
    finished_summary,
    maybe_resume,
    note_membership,
    wait_or_raise,
)
from examples.gpt.scalars import Scalars  # noqa: E402
from examples.gpt.schedule import lr_at, lr_horizon, resume_note  # noqa: E402
from examples.gpt.specs import at_least, checkpoint_spec, forbid_spec  # noqa: E402
from examples.gpt.tensor_parallel import (  # noqa: E402 - registers the block rule
    add_split_args,
    check_split_args,
    split_blocks,
)
from whale.planner.balance import InfeasiblePlanError  # noqa: E402
from whale.runtime import elastic, graceful  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; defaults fit ``make train`` (4 CPU processes, 2 cores) in a few minutes."""
    p = Parser(description=__doc__.split("\n")[0])
    a = p.add_argument
    one, zero = at_least(1), at_least(0)
    a("--steps", type=one, default=600, help="optimizer steps in total (a resumed run continues to it)")
    a("--stop-after", type=one, default=None,
      help="stop (with a checkpoint) after this step, as if interrupted; --resume continues to --steps")
    a("--batch-size", type=one, default=32, help="global batch (sequences per step, all ranks together)")
    a("--seq-len", type=one, default=128, help="tokens per sequence (= model block size)")
    a("--n-layer", type=one, default=4)
    a("--n-head", type=one, default=4)
    a("--n-embd", type=one, default=128)
    a("--dropout", type=float, default=0.0)
    a("--vocab-size", type=one, default=2048, help="BPE vocabulary (re-tokenizes the cache if it differs)")
    a("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine decay to 10%%)")
    a("--warmup", type=zero, default=None, help="warmup steps (default: 5%% of --steps)")
    a("--weight-decay", type=float, default=0.1)
    a("--micro-batches", type=one, default=4, help="micro-batches per step (pipeline depth)")
    a("--stages", type=one, default=2, help="pipeline stages (wh.replicate(1) scopes in the model)")
    a("--stage-layers", type=str, default=None,
      help="blocks per stage as annotated, e.g. 3,1 (default: even); on a mixed cluster the hardware-aware planner "
           "re-cuts the stages by device speed (the annotations then fix only the stage count); under --schedule "
           "interleaved, blocks per chunk (stages x V counts)")
    add_schedule_args(a)
    a("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
      help="autocast dtype of the forward; fp16 adds dynamic loss scaling (master weights stay fp32)")
    a("--eval-every", type=zero, default=200, help="held-out evaluation every N steps (0: start/end only)")
    a("--eval-batches", type=one, default=8, help="held-out batches per evaluation (fixed set)")
    a("--ckpt-dir", default="checkpoints/gpt")
    a("--ckpt-every", type=ckpt_every, default=0, help="checkpoint every N steps (0: only at the end; auto: from the "
      "measured save cost, see --max-lost-seconds)")
    add_adaptive_args(a)
    add_resume_args(p)
    add_elastic_args(a)
    a("--timeout", type=float, default=None,
      help="seconds a collective waits for a dead or failed peer before every rank stops (Config.timeout_s)")
    a("--log-every", type=one, default=25, help="log line every N steps when not showing a progress bar")
    a("--sample-tokens", type=zero, default=120, help="tokens to generate at the end (0: none)")
    a("--prompt", default="Ham.\n", help="prompt for the generated sample")
    a("--seed", type=int, default=1337)
    a("--data-dir", default=str(DEFAULT_DATA_DIR))
    a("--global-batches", action="store_true", help="every rank gets the global batch (engine.step), not its rows")
    a("--cluster", default=None, help="cluster spec (YAML) passed to wh.Config(cluster=...)")
    _memory_args(a)
    add_split_args(p)
    add_moe_args(p)
    add_prediction_args(a)
    a("--summary", default="runs/gpt_summary.json", help="JSON summary path (written by rank 0)")
    a("--tensorboard", default="runs/tb", help="TensorBoard log directory (rank 0; '' for none)")
    a("--no-progress", action="store_true",
      help="no progress bar, log lines every 25 steps instead (the default when stderr is not a terminal)")
    return p.parse_args(argv)


def _memory_args(a) -> None:
    """The memory flags (recompute, ZeRO, offload, what the planner may not add); ``a`` is ``add_argument``."""
    a("--activation-checkpoint", nargs="?", const="all", default=None, metavar="WHAT",
      help="recompute activations in backward: 'all' (the default when given bare: every block), or a comma "
           "list of module types, FQN globs and TaskGraph indices, e.g. Block or blocks.0,blocks.1")
    a("--track-memory", action="store_true",
      help="measure memory per rank on a plain CPU run too (always on under an emulated cluster)")
    a("--zero", type=int, default=0, choices=[0, 1, 2, 3],
      help="ZeRO stage over each pipeline stage's data-parallel lanes: 1 shards the AdamW state, 2 also the "
           "gradients, 3 also the parameters (slices sized by each device's free memory on a cluster spec)")
    a("--offload", default="none", choices=["none", "optimizer", "optimizer+params"],
      help="keep the AdamW state (each lane's ZeRO slice), fp32 masters and gradients in host memory and step there "
           "(ZeRO-Offload); optimizer+params also keeps the parameters on the host between steps (needs --zero 0)")
    a("--forbid", default="", metavar="NAMES", help="memory techniques the planner must not add when the plan does "
      "not fit: comma list of activation_checkpoint, zero, zero3, offload, offload_params ('all': every one)")


loss_fn = wh.token_cross_entropy()
"""Next-token cross-entropy averaged over the target tokens of the whole global batch (logits [b, T, V],
y [b, T]); ``ignore_index=-100`` targets (padding) would not count."""


def prepare_data(args: argparse.Namespace, rank: int) -> dict[str, Path]:
    """Rank 0 fetches/tokenizes (cached) while the others wait; then everyone opens the cache.

    A failure on rank 0 is broadcast so that every rank stops with the reason instead of hanging.
    """
    error = [None]
    if rank == 0:
        try:
            prepare(args.data_dir, args.vocab_size)
        except Exception as exc:  # re-raised on every rank below
            error[0] = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise RuntimeError(f"preparing the data in {args.data_dir} failed on rank 0: {error[0]}")
    names = dict(tokenizer="tokenizer.json", train="train.bin", val="val.bin", meta="meta.json")
    return {k: Path(args.data_dir) / v for k, v in names.items()}


def build(args: argparse.Namespace, ctx, sample_batch=None) -> tuple[GPTConfig, wh.Engine]:
    """The model (annotated when ``--stages > 1``) and its engine on this rank. ``sample_batch`` lets the
    planner profile the model (fake tensors) for memory-aware shares and speed-balanced stage cuts."""
    cfg, split = model_config(args), split_blocks(args)
    if split:  # a split block refuses attention dropout (each rank holds other heads)
        cfg = dataclasses.replace(cfg, attn_dropout=0.0)
    stage_layers = [int(c) for c in args.stage_layers.split(",")] if args.stage_layers else None
    width = None if not (args.moe_experts or split) or args.stages == 1 else max(1, ctx.world_size // args.stages)
    model = GPT(cfg, stages=args.stages * args.virtual_stages, stage_layers=stage_layers, stage_width=width,
                split_blocks=split)
    n_params = model.num_params()
    engine = wh.parallelize(
        model, loss_fn=moe_loss_fn(model, loss_fn) if args.moe_experts else loss_fn,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                                                   betas=(0.9, 0.95)),
        sample_batch=sample_batch,
    )
    if ctx.rank == 0:
        print(f"GPT: {n_params:,} parameters, {cfg}", flush=True)
        print(engine.plan, flush=True)
    return cfg, engine


def evaluate(engine: wh.Engine, val_tokens, args: argparse.Namespace) -> float:
    """Mean held-out loss over the fixed ``--eval-batches`` batches (collective: every rank calls it)."""
    losses = [engine.eval_step(b)["loss"] for b in eval_batches(val_tokens, args.eval_batches,
                                                                args.batch_size, args.seq_len)]
    return sum(losses) / len(losses)


def save(engine: wh.Engine, args, step: int, batches: TokenBatches, state: dict) -> None:
    """Checkpoint model/optimizer/RNG (library) plus step, data position and the run's history (extra)."""
    engine.save_checkpoint(args.ckpt_dir, extra={"step": step, "data": batches.state_dict(), **state})


def train_loop(engine, args, batches, val_tokens, start: int, end: int, state: dict, scalars: Scalars,
               stop: graceful.GracefulStop | None = None) -> dict:
    """Run steps ``start..end-1``; returns ``state`` with val losses, train losses, throughput and times. With
    ``stop`` (an elastic job), a SIGTERM on any rank ends the run after the current step with a checkpoint."""
    rank0 = engine.rank == 0
    tokens_per_step = args.batch_size * args.seq_len
    plain = args.no_progress or not sys.stderr.isatty()  # a log file gets log lines, not bar redraws
    bar = tqdm(total=args.steps, initial=start, disable=not rank0 or plain, dynamic_ncols=True,
               desc="train", unit="step")
    state.setdefault("val", [])
    state.setdefault("train_time", 0.0)
    state.setdefault("train_tokens", 0)
    state.setdefault("train_loss", [])
    adapt = Adaptive(args, engine, batches, end)  # --ckpt-every auto, --slowdown-at, --stragglers
    for step in range(start, end):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, args, state["lr_horizon"])
        batch = next(batches)  # this rank's rows only (unless --global-batches)
        if args.global_batches:
            m = engine.step(batch)
        else:  # stage 0 needs the inputs, the last stage the targets, a middle stage nothing
            m = engine.step_local(batch if batches.rows else None, args.batch_size)
        state["train_time"] += m["step_time"]
        state["train_tokens"] += tokens_per_step
        state["train_loss"].append(m["loss"])
        if "loss_scale" in m:  # fp16: the dynamic loss scale and the steps an overflow skipped (on every rank)
            state["loss_scale"], state["skipped_steps"] = m["loss_scale"], state.get("skipped_steps", 0) + m["skipped"]
        tok_s = state["train_tokens"] / state["train_time"]
        lr = lr_at(step, args, state["lr_horizon"])
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.1e}")
        scalars.step(step + 1, m["loss"], tok_s, lr)
        bar.update(1)
        done = step + 1
        if plain and rank0 and (done % args.log_every == 0 or done == end):
            print(f"step {done}/{args.steps} loss {m['loss']:.4f} tok/s {tok_s:,.0f}", flush=True)
        if (args.eval_every and done % args.eval_every == 0) or done == end:
            v = evaluate(engine, val_tokens, args)
            state["val"].append([done, v])
            scalars.eval(done, v)
            if rank0:
                bar.write(f"step {done}: held-out loss {v:.4f} (train loss {m['loss']:.4f})")
        adapt.after_step(done, m)
        saved = adapt.save_due(done, end)
        if saved:
            adapt.timed_save(lambda: save(engine, args, done, batches, state), done)  # noqa: B023 - called now
        if stop is not None and done != end and stop.requested():  # torchrun restarts the group (a node joined)
            if not saved:
                save(engine, args, done, batches, state)
            stop.exit(f"elastic: SIGTERM: stopped after step {done} with a checkpoint" if rank0 else None)
    bar.close()
    state["adaptive"] = adapt.record
    return state


def main(argv: list[str] | None = None) -> None:
    """Run the job; a configuration error prints Whale's one ``error:`` line on each rank (``wh.report_error``,
    no traceback) and exits with status 2. Any other error reaches Whale's error report (``wh.init`` installs
    it): one line per failing rank, the first one's traceback."""
    try:
        run(argv)
    except (wh.ConfigError, wh.PlanError, wh.AnnotationError, wh.StageError, wh.CheckpointError, ValueError) as exc:
        wh.report_error(exc, traceback=False)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def run(argv: list[str] | None = None) -> None:
    """Train, evaluate, checkpoint, sample (see the module docstring)."""
    args = parse_args(argv)
    bad = check_schedule_args(args)
    if bad:
        raise wh.ConfigError(bad)
    wall0 = time.time()
    ctx = wh.init(wh.Config(num_micro_batch=args.micro_batches, schedule=args.schedule, seed=args.seed,
                            cluster=args.cluster, precision=args.precision, zero=args.zero, offload=args.offload,
                            activation_checkpoint=checkpoint_spec(args.activation_checkpoint),
                            track_memory=True if args.track_memory else None, forbid=forbid_spec(args.forbid),
                            timeout_s=args.timeout, virtual_stages=args.virtual_stages,
                            sequence_parallel=args.sequence_parallel))
    bad = check_split_args(args, ctx.world_size)
    if bad:
        raise wh.ConfigError(bad)
    paths = prepare_data(args, ctx.rank)
    batches = TokenBatches(load_tokens(paths["train"]), args.batch_size, args.seq_len, seed=args.seed)
    try:
        cfg, engine = build(args, ctx, sample_batch=batches.batch(0))
    except InfeasiblePlanError as exc:  # an elastic job that may still grow waits for a node to join
        wait_or_raise(exc, args, ctx)
    val_tokens = load_tokens(paths["val"])
    start, state = maybe_resume(engine, args, batches)
    note_membership(ctx, state)  # an elastic job: the nodes present, and what changed since the checkpoint
    if not args.global_batches:  # after a resume: its plan may carry the checkpoint's shares
        loads = engine.stage in (0, engine.plan.num_stages - 1)
        batches.rows = wh.local_rows(engine.plan, ctx.rank, args.batch_size) if loads else []
    state["lr_horizon"] = lr_horizon(args, state.get("lr_horizon"))
    note = resume_note(start, args.steps, state["lr_horizon"]["steps"], args.lr / 10,
                       f"the checkpoint in {args.ckpt_dir}")
    if note and ctx.rank == 0:
        print(note, flush=True)
    if start >= args.steps and finished_summary(args, start, engine):  # a job restarted after its final
        dist.destroy_process_group()  # checkpoint: done, a success; its summary is there
        return
    scalars = Scalars(args.tensorboard, ctx.rank)
    # done but its summary unwritten (stopped right after the final save): the summary from the checkpoint's history
    end = start if start >= args.steps else train(engine, args, batches, val_tokens, start, state, scalars)
    if args.trace and end > start:  # collective: every rank's last step, written by rank 0
        if wh.write_step_trace(engine, args.trace):
            print(f"wrote the last step's trace to {args.trace} (open it in Perfetto or chrome://tracing)")
    full = engine.full_state_dict()
    state["optimizer_state_bytes"] = optimizer_state_bytes(engine)
    bubble = bubble_report(engine, args)
    state["predicted"] = prediction_report(engine, args, bubble, state)  # the planner's step beside the measured
    state["memory"], memory_table = wh.memory_table(engine)  # collective: every rank's measured peaks
    scalars.close(end, bubble)
    if ctx.rank == 0:
        print("\n" + memory_table, flush=True)
        finish(args, cfg, engine, full, state, bubble, time.time() - wall0)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(engine, args, batches, val_tokens, start: int, state: dict, scalars: Scalars) -> int:
    """The initial evaluation, steps ``start..`` to ``--steps`` (or ``--stop-after``) and the final checkpoint;
    returns the last step (``state`` gets the history)."""
    if "val0" not in state:
        state["val0"] = evaluate(engine, val_tokens, args)
    claim_fresh(engine, args)  # --overwrite: the old run's checkpoints go only now, after a forward of every stage
    if engine.rank == 0:
        print(f"step 0: held-out loss {state['val0']:.4f} (ln vocab = {math.log(args.vocab_size):.4f})"
              + (f"; resuming at step {start}" if start else ""))
    end = min(args.steps, args.stop_after) if args.stop_after else args.steps
    if start == 0:
        scalars.eval(0, state["val0"])
    with graceful.on_sigterm(bool(os.environ.get(elastic.NNODES_ENV))) as stop:
        state.update(train_loop(engine, args, batches, val_tokens, start, end, state, scalars, stop))
    state["steps_done"] = end
    save(engine, args, end, batches, state)
    return end


if __name__ == "__main__":
    main()
