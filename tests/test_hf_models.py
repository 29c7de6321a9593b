"""Hugging Face ``transformers`` models, captured with ``torch.export``, pipelined by mapping annotations.

GPT-2 (tied embedding / LM head) under data parallel x pipeline and Llama (untied, rotary, GQA) under a
pipeline of split stages, at world 4, from tiny configs (no download), each against a one-process ``deepcopy``
reference trained by plain PyTorch on the whole batch: token-mean cross-entropy with ignored (-100) labels, the
user's AdamW with two param groups and an LR scheduler, keyword inputs (``attention_mask`` sliced per row,
``use_cache=False`` passed whole).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import whale as wh
from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ, BATCH = 64, 8, 8


def tiny(kind: str) -> torch.nn.Module:
    """A tiny GPT-2 or Llama causal LM, without dropout (one process and Whale draw masks differently)."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def stages(kind: str, split: bool = False) -> dict:
    """Two pipeline stages by mapping, one decoder layer each (embedding and head join their neighbours);
    with ``split``, each stage is 2 devices wide (2 data-parallel lanes) and its layer's attention heads and
    MLP are sharded over them (a split nested in the stage's replicate)."""
    layers = "transformer.h" if kind == "gpt2" else "model.layers"
    attn = "attn" if kind == "gpt2" else "self_attn"
    mapping = {}
    for i in range(2):
        with wh.replicate(2 if split else 1) as rep:
            with wh.split(2) as sp:
                pass
        mapping[f"{layers}.{i}"] = rep
        if split:
            mapping |= {f"{layers}.{i}.{attn}": sp, f"{layers}.{i}.mlp": sp}
    return mapping


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[:, -1] = -100
        labels[: BATCH // 2, : SEQ // 2] = -100  # rows with fewer valid tokens: token weighting matters
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}, labels


def optimizer(model, eps: float = 1e-8):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-3, eps=eps)


def _train(rank, world, kind, mb, split=False):
    ctx = wh.init(wh.Config(num_micro_batch=mb, seed=0))
    model = wh.annotate(tiny(kind), stages(kind, split))
    ref = copy.deepcopy(model)
    # sharded projections sum in another order; Adam's eps 1e-6 keeps near-zero gradients from magnifying it
    eps = 1e-6 if split else 1e-8
    opt, ref_opt = optimizer(model, eps), optimizer(ref, eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    engine = wh.parallelize(model, wh.token_cross_entropy(), opt, ctx=ctx, sample_batch=next(batches(1)))
    losses, ref_losses = [], []
    for inputs, labels in batches(3):
        losses.append(engine.step((inputs, labels))["loss"])
        sched.step()
        ref_opt.zero_grad()
        logits = ref(**inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    full = engine.full_state_dict()  # shards gathered back into the model's own layout
    ev = engine.eval_step(next(batches(1)))["loss"]
    if rank == 0:
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(full[name], p, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return engine.plan.capture, losses, ev, len(engine.split.regions)


@pytest.mark.parametrize("kind", ["gpt2"])  # its LM head is tied to the embedding in the other stage
def test_hf_model_dp2_pp2_matches_one_process(kind):
    results = run_ranks(_train, 4, kind, 2, timeout=300)
    assert all(r[0] == "export" for r in results)
    assert len({tuple(r[1]) for r in results}) == 1  # every rank reports the same global loss
    assert all(abs(r[2] - results[0][2]) < 1e-6 for r in results)  # eval_step agrees on every rank


@pytest.mark.parametrize("kind", ["llama"])  # rotary, grouped-query heads split
def test_hf_model_pp2_with_dp_and_split_heads_matches_one_process(kind):
    """World 4: 2 pipeline stages, each 2 devices wide (2 data-parallel lanes) with its attention heads and MLP
    split over them. (GPT-2's split attention and MLP: tests/test_hf_split.py.)"""
    results = run_ranks(_train, 4, kind, 2, True, timeout=300)
    assert all(r[0] == "export" for r in results)
    assert [r[3] for r in results] == [2, 2, 2, 2]  # attention + MLP regions on every rank of both stages


def test_export_capture_plans_gpt2_without_processes():
    model = wh.annotate(tiny("gpt2"), stages("gpt2"))
    plan = wh.plan_model(model, 2, wh.Config(num_micro_batch=2), sample_batch=next(batches(1)))
    assert plan.capture == "export" and [c.name for c in plan.capture_inputs] == \
        ["input_ids", "attention_mask", "use_cache"]
    assert wh.Plan.from_json(plan.to_json()) == plan
    # the tied embedding stays in stage 0 (owned under its own name) and is shared with the head's stage
    assert "transformer.wte.weight" in plan.stage_cuts[0].params
    assert plan.shared_params[0].names == ("lm_head.weight", "transformer.wte.weight")
    fx_plan = wh.plan_model(model, 2, wh.Config(num_micro_batch=2, capture="export"),
                            sample_batch=next(batches(1)))
    assert fx_plan == plan


class _Untraceable(torch.nn.Module):
    """fx cannot trace it (unpacks x.shape, *args/**kwargs forward); export can."""

    def __init__(self, d=8, vocab=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.a = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.5)
        self.b = torch.nn.Linear(d, vocab)

    def forward(self, *args, **kwargs):
        x = self.emb(kwargs.get("ids", args[0] if args else None))
        b, t, d = x.shape
        h = torch.nn.functional.dropout(self.a(x).reshape(b * t, d), 0.3, training=self.training)
        return self.b(self.drop(h)).reshape(b, t, -1)


def test_export_stages_follow_train_and_eval_like_the_model():
    from whale.parallel.stages import build_stage

    model = wh.annotate(_Untraceable(), {"a": wh.replicate(1), "b": wh.replicate(1)})
    ids = torch.randint(0, 16, (4, 5))
    with pytest.raises(wh.StageError, match="sample_batch"):
        wh.plan_model(model, 2)  # fx cannot trace it and says how to capture it with torch.export
    plan = wh.plan_model(model, 2, sample_batch=(ids, ids))
    assert plan.capture == "export"
    s0, s1 = build_stage(model, plan, 0), build_stage(model, plan, 1)
    torch.manual_seed(3)
    mine = s1(*s0(ids))
    torch.manual_seed(3)
    torch.testing.assert_close(mine, model(ids))  # same dropout masks: same ops, same order, same RNG
    model.eval()
    assert torch.equal(s1(*s0(ids)), model(ids))  # the eval graph: no dropout at all
    model.train()
    s0.eval(), s1.eval()
    assert torch.equal(s1(*s0(ids)), model.eval()(ids))


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:  # Python branch on a tensor value: no graph can hold it
            x = x * 2
        return self.b(x)


def test_export_failure_names_the_error_and_the_fixes():
    model = wh.annotate(_DataDependent(), {"a": wh.replicate(1), "b": wh.replicate(1)})
    x = torch.randn(4, 4)
    with pytest.raises(wh.StageError, match=r"torch.export.export\(strict=False\) failed.*torch.cond"):
        wh.plan_model(model, 2, sample_batch=(x, x))
