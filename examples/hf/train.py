"""Train a Llama-style model from Hugging Face ``transformers`` on Shakespeare with Whale, by mapping.

The model is ``transformers.LlamaForCausalLM`` built from a small ``LlamaConfig`` (no download), left exactly
as ``transformers`` defines it; ``wh.annotate`` maps its decoder layers onto pipeline stages and Whale captures
it with ``torch.export`` to cut the stages. Launch from the repo root (``make train-hf`` does the first)::

    whale launch -n 4 examples/hf/train.py                 # 2 data-parallel lanes x 2 pipeline stages
    whale launch -n 4 --cluster examples/clusters/v100_p100.yaml examples/hf/train.py --steps 100
    whale launch -n 4 examples/hf/train.py --split 2       # 2 stages x 2 devices: heads and MLPs split too
    python examples/hf/train.py --stages 1 --steps 50       # one process

Every rank draws the same global batch; the inputs are keyword arguments (``input_ids``, ``use_cache=False``),
exactly what one would pass to the model; the loss is the token-mean cross-entropy of ``wh.token_cross_entropy``
on the output's ``.logits``. Rank 0 prints the plan, progress, held-out losses and writes a JSON summary.
The run checkpoints to ``--ckpt-dir`` at the end (and every ``--ckpt-every`` steps); ``--resume`` continues from
the latest complete checkpoint with the loss trajectory of an uninterrupted run (model, optimizer, RNG, step,
data position and history restored by the GPT example's helpers; ``--stop-after`` stops early as if interrupted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import whale as wh  # noqa: E402
from examples.cli import Parser  # noqa: E402
from examples.gpt.data import DEFAULT_DATA_DIR, TokenBatches, eval_batches, load_tokens  # noqa: E402
from examples.gpt.runs import add_resume_args, claim_fresh, maybe_resume  # noqa: E402
from examples.gpt.schedule import lr_at, lr_horizon, resume_note  # noqa: E402
from examples.gpt.specs import at_least  # noqa: E402
from examples.gpt.train import prepare_data, save  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; defaults fit 4 CPU processes on 2 cores in a few minutes."""
    p = Parser(description=__doc__.split("\n")[0])
    a = p.add_argument
    one, zero = at_least(1), at_least(0)
    a("--steps", type=one, default=200, help="optimizer steps in total (a resumed run continues to it)")
    a("--stop-after", type=one, default=None,
      help="stop (with a checkpoint) after this step, as if interrupted; --resume continues to --steps")
    a("--batch-size", type=one, default=32, help="global batch (sequences per step, all ranks together)")
    a("--seq-len", type=one, default=128)
    a("--layers", type=one, default=4)
    a("--hidden", type=one, default=128)
    a("--heads", type=one, default=4)
    a("--kv-heads", type=one, default=2, help="key/value heads (grouped-query attention)")
    a("--vocab-size", type=one, default=2048, help="BPE vocabulary of the Shakespeare tokenizer")
    a("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine to 10%%)")
    a("--warmup", type=zero, default=None, help="warmup steps (default: 5%% of --steps)")
    a("--micro-batches", type=one, default=4)
    a("--stages", type=one, default=2, help="pipeline stages: decoder layers split evenly by wh.annotate")
    a("--split", type=one, default=1,
      help="devices per stage: each stage's lanes also shard its attention heads and MLPs (tensor parallel); "
           "the world size must be a multiple of stages x split")
    a("--schedule", default="1F1B", choices=["1F1B", "GPipe"])
    a("--eval-every", type=zero, default=100, help="held-out evaluation every N steps (0: at the start and end only)")
    a("--eval-batches", type=one, default=4)
    a("--seed", type=int, default=1337)
    a("--data-dir", default=str(DEFAULT_DATA_DIR))
    a("--cluster", default=None, help="cluster spec (YAML); whale launch --cluster sets it too")
    a("--ckpt-dir", default="checkpoints/hf_llama")
    a("--ckpt-every", type=zero, default=0, help="checkpoint every N steps (0: only at the end)")
    add_resume_args(p)
    a("--summary", default="runs/hf_llama_summary.json")
    args = p.parse_args(argv)
    for what, n, d in (("--hidden", args.hidden, args.heads), ("--heads", args.heads, args.kv_heads)):
        if n % d:
            by = "--heads" if what == "--hidden" else "--kv-heads"
            p.error(f"{what} {n} is not a multiple of {by} {d}: pass {by} dividing it or {what} a multiple of {d}")
    if args.layers % args.stages:
        p.error(f"--layers {args.layers} is not a multiple of --stages {args.stages}; pass --stages dividing it "
                f"or --layers a multiple of {args.stages}")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """``LlamaForCausalLM`` from a small config, annotated into ``--stages`` pipeline stages by mapping."""
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    if args.stages > 1 or args.split > 1:
        per, mapping = args.layers // args.stages, {}
        for s in range(args.stages):
            with wh.replicate(args.split) as stage:
                with wh.split(args.split) as shard:
                    pass
            for j in range(s * per, (s + 1) * per):
                mapping[f"model.layers.{j}"] = stage
                if args.split > 1:
                    mapping |= {f"model.layers.{j}.self_attn": shard, f"model.layers.{j}.mlp": shard}
        wh.annotate(model, mapping)
    return model


def keyword(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """``(x, y)`` token windows as the model's keyword inputs and the next-token labels."""
    x, y = batch
    return {"input_ids": x, "use_cache": False}, y


def evaluate(engine: wh.Engine, val_tokens, args: argparse.Namespace) -> float:
    """Mean held-out loss over a fixed set of batches (collective: every rank calls it)."""
    batches = eval_batches(val_tokens, args.eval_batches, args.batch_size, args.seq_len)
    losses = [engine.eval_step(keyword(b))["loss"] for b in batches]
    return sum(losses) / len(losses)


def train(engine: wh.Engine, args, batches: TokenBatches, val_tokens, start: int, end: int, state: dict) -> dict:
    """Steps ``start..end-1`` (the LR the GPT example's schedule under the run's horizon); returns ``state``
    with the held-out curve ``val``, ``train_loss`` and ``train_time``; checkpoints every ``--ckpt-every``."""
    rank0 = engine.rank == 0
    plain = not sys.stderr.isatty()
    bar = tqdm(total=args.steps, initial=start, disable=not rank0 or plain, desc="train", unit="step",
               dynamic_ncols=True)
    for step in range(start, end):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, args, state["lr_horizon"])
        m = engine.step(keyword(next(batches)))
        state["train_time"] += m["step_time"]
        state["train_loss"].append(m["loss"])
        bar.set_postfix(loss=f"{m['loss']:.3f}")
        bar.update(1)
        done = step + 1
        if plain and rank0 and (done % 25 == 0 or done == end):
            print(f"step {done}/{args.steps} loss {m['loss']:.4f}", flush=True)
        if (args.eval_every and done % args.eval_every == 0) or done == end:
            state["val"].append([done, evaluate(engine, val_tokens, args)])
            if rank0:
                bar.write(f"step {done}: held-out loss {state['val'][-1][1]:.4f}")
        if args.ckpt_every and done % args.ckpt_every == 0 and done != end:
            save(engine, args, done, batches, state)
    bar.close()
    return state


def run(argv: list[str] | None = None) -> dict:
    """Train and evaluate (resuming with ``--resume``), checkpoint at the end; rank 0 returns (and writes) the
    summary (``{}`` when the checkpoint is already at ``--steps``: nothing to do, the job succeeds).
    """
    args = parse_args(argv)
    ctx = wh.init(wh.Config(num_micro_batch=args.micro_batches, schedule=args.schedule, seed=args.seed,
                            cluster=args.cluster))
    paths = prepare_data(args, ctx.rank)
    batches = TokenBatches(load_tokens(paths["train"]), args.batch_size, args.seq_len, seed=args.seed)
    val_tokens = load_tokens(paths["val"])
    model = build_model(args)
    engine = wh.parallelize(model, wh.token_cross_entropy(), torch.optim.AdamW(model.parameters(), lr=args.lr),
                            sample_batch=keyword(batches.batch(0)))
    rank0 = ctx.rank == 0
    if rank0:
        print(f"LlamaForCausalLM: {sum(p.numel() for p in model.parameters()):,} parameters\n{engine.plan}", flush=True)
    start, state = maybe_resume(engine, args, batches)
    state["lr_horizon"] = lr_horizon(args, state.get("lr_horizon"))
    note = resume_note(start, args.steps, state["lr_horizon"]["steps"], args.lr / 10,
                       f"the checkpoint in {args.ckpt_dir}")
    if note and rank0:
        print(note, flush=True)
    if start >= args.steps:  # already done (e.g. a job restarted after its final checkpoint): success
        dist.destroy_process_group()
        return {}
    if "val" not in state:  # a fresh run (a resumed one has its history)
        state.update(val=[[0, evaluate(engine, val_tokens, args)]], train_loss=[], train_time=0.0)
    claim_fresh(engine, args)  # --overwrite: the old run's checkpoints go only now, after a forward of every stage
    end = min(args.steps, args.stop_after) if args.stop_after else args.steps
    state = train(engine, args, batches, val_tokens, start, end, state)
    save(engine, args, end, batches, state)
    val = state["val"]
    tok_s = len(state["train_loss"]) * args.batch_size * args.seq_len / max(state["train_time"], 1e-9)
    summary = dict(initial_val_loss=val[0][1], final_val_loss=val[-1][1], val_curve=val, train_loss=state["train_loss"],
                   tokens_per_s=tok_s, steps=end, resumed_from=start, world_size=ctx.world_size,
                   stages=engine.plan.num_stages, capture=engine.plan.capture, config=vars(args))
    if rank0:
        print(f"held-out loss {val[0][1]:.4f} -> {val[-1][1]:.4f}; {tok_s:,.0f} tokens/s; "
              f"checkpoint in {args.ckpt_dir}")
        os.makedirs(os.path.dirname(args.summary) or ".", exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.summary}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def main() -> None:
    """Run the job; a configuration error prints Whale's one ``error:`` line on each rank (``wh.report_error``,
    no traceback) and exits with status 2; any other error reaches the report ``wh.init`` installs."""
    try:
        run()
    except (wh.ConfigError, wh.PlanError, wh.AnnotationError, wh.StageError, wh.CheckpointError,
            ValueError) as exc:
        wh.report_error(exc, traceback=False)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


if __name__ == "__main__":
    t0 = time.time()
    main()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wall time {time.time() - t0:.1f} s")
