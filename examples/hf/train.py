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
"""

from __future__ import annotations

import argparse
import json
import math
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
from examples.gpt.data import DEFAULT_DATA_DIR, TokenBatches, eval_batches, load_tokens  # noqa: E402
from examples.gpt.train import prepare_data  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; defaults fit 4 CPU processes on 2 cores in a few minutes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--steps", type=int, default=200)
    a("--batch-size", type=int, default=32, help="global batch (sequences per step, all ranks together)")
    a("--seq-len", type=int, default=128)
    a("--layers", type=int, default=4)
    a("--hidden", type=int, default=128)
    a("--heads", type=int, default=4)
    a("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    a("--vocab-size", type=int, default=2048, help="BPE vocabulary of the Shakespeare tokenizer")
    a("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup 5%%, cosine to 10%%)")
    a("--micro-batches", type=int, default=4)
    a("--stages", type=int, default=2, help="pipeline stages: decoder layers split evenly by wh.annotate")
    a("--split", type=int, default=1,
      help="devices per stage: each stage's lanes also shard its attention heads and MLPs (tensor parallel); "
           "the world size must be a multiple of stages x split")
    a("--schedule", default="1F1B", choices=["1F1B", "GPipe"])
    a("--eval-every", type=int, default=100)
    a("--eval-batches", type=int, default=4)
    a("--seed", type=int, default=1337)
    a("--data-dir", default=str(DEFAULT_DATA_DIR))
    a("--cluster", default=None, help="cluster spec (YAML); whale launch --cluster sets it too")
    a("--summary", default="runs/hf_llama_summary.json")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """``LlamaForCausalLM`` from a small config, annotated into ``--stages`` pipeline stages by mapping."""
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    if args.stages > 1 or args.split > 1:
        if args.layers % args.stages:
            raise ValueError(f"--layers {args.layers} is not a multiple of --stages {args.stages}; pass --stages "
                             f"dividing it (e.g. 2) or --layers a multiple of {args.stages}")
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


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over 5% of the steps, then cosine from ``--lr`` to ``--lr``/10."""
    warm = max(1, args.steps // 20)
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, args.steps - warm))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(engine: wh.Engine, val_tokens, args: argparse.Namespace) -> float:
    """Mean held-out loss over a fixed set of batches (collective: every rank calls it)."""
    batches = eval_batches(val_tokens, args.eval_batches, args.batch_size, args.seq_len)
    losses = [engine.eval_step(keyword(b))["loss"] for b in batches]
    return sum(losses) / len(losses)


def run(argv: list[str] | None = None) -> dict:
    """Train and evaluate; rank 0 returns (and writes) the summary."""
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
    val = [(0, evaluate(engine, val_tokens, args))]
    plain = not sys.stderr.isatty()
    bar = tqdm(total=args.steps, disable=not rank0 or plain, desc="train", unit="step", dynamic_ncols=True)
    t_train, losses = 0.0, []
    for step in range(args.steps):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        m = engine.step(keyword(next(batches)))
        t_train += m["step_time"]
        losses.append(m["loss"])
        bar.set_postfix(loss=f"{m['loss']:.3f}")
        bar.update(1)
        done = step + 1
        if plain and rank0 and (done % 25 == 0 or done == args.steps):
            print(f"step {done}/{args.steps} loss {m['loss']:.4f}", flush=True)
        if done % args.eval_every == 0 or done == args.steps:
            val.append((done, evaluate(engine, val_tokens, args)))
            if rank0:
                bar.write(f"step {done}: held-out loss {val[-1][1]:.4f}")
    bar.close()
    tok_s = args.steps * args.batch_size * args.seq_len / max(t_train, 1e-9)
    summary = dict(initial_val_loss=val[0][1], final_val_loss=val[-1][1], val_curve=val, train_loss=losses,
                   tokens_per_s=tok_s, world_size=ctx.world_size, stages=engine.plan.num_stages,
                   capture=engine.plan.capture, config=vars(args))
    if rank0:
        print(f"held-out loss {val[0][1]:.4f} -> {val[-1][1]:.4f}; {tok_s:,.0f} tokens/s")
        os.makedirs(os.path.dirname(args.summary) or ".", exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.summary}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def main() -> None:
    """Run the job; a configuration error prints one line (rank 0) and exits with status 2."""
    try:
        run()
    except (wh.ConfigError, wh.PlanError, wh.AnnotationError, wh.StageError, ValueError) as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


if __name__ == "__main__":
    t0 = time.time()
    main()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wall time {time.time() - t0:.1f} s")
