"""split on Hugging Face ``transformers`` models: a tiny Llama with every layer's attention and MLP sharded
(nested in the replicate that holds the rest, or beside it) trains as one process does; GPT-2's attention (fused
q|k|v) and MLP too; bad head counts and sizes are refused at plan time with a SplitError naming the module.

Every distributed check compares with a ``copy.deepcopy`` trained by plain PyTorch (AdamW lr 1e-3, 3 steps,
token-mean cross-entropy with ignored labels): losses at every step and the consolidated parameters at the end,
fp32, rtol 1e-5 / atol 1e-6. Models are built from tiny configs (no download).
"""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import whale as wh  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.test_split_runtime import _with_shard_weights  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RTOL, ATOL = 1e-5, 1e-6
# AdamW's eps at 1e-6, not 1e-8: a gradient element near zero (|g| ~ eps, e.g. through SiLU's flat tail) turns the
# fp32 rounding of a different summation order (shards, then an all-reduce) into an update difference of up to
# lr * dg / (4 eps); at 1e-8 one weight of ~22k drifted 1.4e-6 after 3 steps, at 1e-6 3e-7 (both sides use it)
EPS = 1e-6


def _llama(heads=4, kv=2, attn="sdpa"):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48 if heads == 6 else 32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                                   attention_dropout=0.0, max_position_embeddings=32)
    cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(attn="sdpa"):
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = attn
    return transformers.GPT2LMHeadModel(cfg)


def _annotate(model, spec):
    """The layers' attention and MLP under one split: nested in a replicate holding the rest (``nested``), or a
    top-level split beside it (colocated, sharing the devices)."""
    count = spec.get("count")
    with wh.replicate(count) as rep:
        if spec.get("nested", True):
            with wh.split(count) as sp:
                pass
    if not spec.get("nested", True):
        sp = wh.split(count)
    layers = "model.layers.*" if spec["model"] == "llama" else "transformer.h.*"
    parts = {"llama": ("mlp", "self_attn"), "gpt2": ("mlp", "attn")}[spec["model"]]
    rest = {name: rep for name, _ in model.named_children()}
    return wh.annotate(model, {**rest, **{f"{layers}.{p}": sp for p in parts}})


def _batches(spec, steps=3):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (spec["batch"], 7), generator=g)
        y = torch.roll(ids, -1, dims=1)
        y[:, -1] = -100
        y[torch.rand(y.shape, generator=g) < 0.2] = -100
        mask = torch.ones_like(ids)
        if spec.get("padding"):
            mask[1, 5:] = mask[4, 3:] = 0  # right padding: those positions' labels are ignored
            y[mask == 0] = -100
        out.append(({"input_ids": ids, "attention_mask": mask, "use_cache": False}, y))
    return out


def _train(rank, world, spec):
    ctx = wh.init(wh.Config(load_shares=spec.get("shares"), seed=0))
    attn = spec.get("attn", "sdpa")
    model = _llama(*spec.get("heads", (4, 2)), attn) if spec["model"] == "llama" else _gpt2(attn)
    ref = copy.deepcopy(model)
    _annotate(model, spec)
    plan = _with_shard_weights(wh.plan_model(model, world, ctx.config), spec.get("shard_weights"))
    tce = wh.token_cross_entropy()
    loss_fn = wh.SumOverCount(lambda out, y: tce(out.logits, y), tce.count_fn)
    engine = wh.parallelize(model, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=EPS), ctx=ctx, plan=plan)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=EPS)
    losses, ref_losses = [], []
    for inputs, y in _batches(spec):
        losses.append(engine.step((inputs, y))["loss"])
        ref_opt.zero_grad()
        logits = ref(**inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    full = engine.full_state_dict()
    shards = {n: tuple(m.sizes) for n, m in engine.module.named_modules() if hasattr(m, "sizes")}
    if rank == 0:
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(full[name], t, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return {"losses": losses, "ref": ref_losses, "regions": len(engine.split.regions), "shards": shards,
            "plan": plan.to_json()}


def _check(results, regions):
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref"]), rtol=RTOL, atol=ATOL)
        assert r["regions"] == regions


@pytest.mark.parametrize("spec", [
    {"model": "llama", "batch": 8, "padding": True},  # sdpa; both ranks hold padded rows
    {"model": "llama", "batch": 8, "shares": (5, 3), "shard_weights": (1, 3), "padding": True, "attn": "eager"},
    {"model": "llama", "batch": 6, "heads": (6, 3), "nested": False},
])
def test_llama_split_attention_and_mlp_match_one_process(spec):
    results = run_ranks(_train, 2, spec, timeout=120)
    _check(results, regions=4)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.num_stages == 1 and plan.stage_width == 2 and plan.colocated == (not spec.get("nested", True))
    shards = results[0]["shards"]
    if spec.get("shard_weights"):  # 1:3 of 2 kv heads rounds to whole heads; the MLP's 64 features cut 16/48
        assert shards["model.layers.0.self_attn.sharded.k_proj"] == (8, 8)
        assert shards["model.layers.0.self_attn.sharded.q_proj"] == (16, 16)
        assert shards["model.layers.0.mlp.sharded.gate_proj"] == (16, 48)
    if spec.get("heads") == (6, 3):  # 3 kv heads over 2 ranks: uneven by whole heads
        assert shards["model.layers.1.self_attn.sharded.v_proj"] == (16, 8)
        assert shards["model.layers.1.self_attn.sharded.o_proj"] == (32, 16)


def test_masks_built_on_some_ranks_only_are_refused_on_every_rank():
    # sdpa builds no mask for rows without padding: rank 0's rows hold padding, rank 1's do not
    with pytest.raises(RuntimeError) as err:
        run_ranks(_train, 2, {"model": "llama", "batch": 8, "padding": True, "shares": (5, 3)}, timeout=120)
    msg = str(err.value)
    assert "SplitError" in msg and "argument kwargs['attention_mask']" in msg and "per rank: [2, 0]" in msg
    assert "attn_implementation='eager'" in msg


def test_llama_split_nested_in_data_parallel_replicas():
    results = run_ranks(_train, 4, {"model": "llama", "batch": 8, "count": 2, "shard_weights": (2, 1)},
                        timeout=120)
    _check(results, regions=4)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.num_replicas == 2 and plan.stage_width == 2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_split_attention_and_mlp_match_one_process(attn):
    spec = {"model": "gpt2", "batch": 8, "shard_weights": (3, 1), "attn": attn, "padding": attn == "eager"}
    results = run_ranks(_train, 2, spec, timeout=120)
    _check(results, regions=4)
    shards = results[0]["shards"]
    assert shards["transformer.h.0.mlp.sharded.c_fc"] == (96, 32)
    assert shards["transformer.h.0.attn.sharded.c_attn"] == (72, 24)  # q|k|v of 3 and 1 heads of 8
    assert shards["transformer.h.1.attn.sharded.c_proj"] == (24, 8)


# --- plan time: refusals, no processes -------------------------------------------------------------------
def test_too_few_kv_heads_are_refused_at_plan_time():
    model = _annotate(_llama(heads=4, kv=1), {"model": "llama"})  # one kv head (MQA) cannot be cut 2 ways
    with pytest.raises(wh.SplitError) as err:
        wh.plan_model(model, 2)
    msg = str(err.value)
    assert "model.layers.0.self_attn" in msg and "LlamaAttention" in msg and "key/value heads" in msg
    assert "it has 1" in msg and "at most 1 device" in msg


def test_three_kv_heads_over_four_devices_refused_and_sizes_not_whole_heads_refused():
    model = _annotate(_llama(heads=6, kv=3), {"model": "llama"})
    with pytest.raises(wh.SplitError, match=r"over 4 devices .*self_attn.*it has 3"):
        wh.plan_model(model, 4)
    from whale.splitrules_hf import unit_shards

    # explicit element sizes must be whole kv heads: 3 kv heads x 2 query heads x head_dim 8 = units of 16
    with pytest.raises(wh.SplitError, match=r"shard sizes \[24, 24\].*multiple of 16"):
        unit_shards(3, 2, sizes=[24, 24], unit=16, what="key/value heads", where="module 'attn'")


def test_gpt2_too_few_heads_refused_at_plan_time():
    model = _annotate(_gpt2(), {"model": "gpt2"})
    with pytest.raises(wh.SplitError, match=r"over 8 devices .*transformer.h.0.attn.*GPT2Attention.*it has 4"):
        wh.plan_model(model, 8)


def test_planning_a_transformers_model_imports_no_runtime():
    code = ("import sys, whale as wh\nfrom tests.test_hf_split import _llama, _annotate\n"
            "print(wh.plan_model(_annotate(_llama(), {'model': 'llama'}), 2))\n"
            "print('LOADED', sorted(m for m in sys.modules if m.startswith(('whale.runtime', 'whale.parallel'))))\n")
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout and "nested split(2)" in out.stdout


def test_unit_shards_round_weights_to_whole_heads():
    from whale.splitrules_hf import unit_shards

    assert unit_shards(2, 2, weights=[1, 3]) == [1, 1]
    assert unit_shards(8, 2, weights=[3, 1]) == [6, 2]
    assert unit_shards(3, 2, sizes=[32, 16], unit=16) == [2, 1]


def test_a_users_rule_for_a_transformers_type_wins_at_plan_and_run_time():
    from transformers.models.llama.modeling_llama import LlamaMLP

    from whale import splitrules

    saved = splitrules._RULES.get(LlamaMLP), LlamaMLP in splitrules._BUILTIN_RULES

    def mine(module, group, sizes, **ctx):
        return module

    wh.register_split_rule(LlamaMLP, mine, dim_size=lambda mlp: 1)
    try:
        with pytest.raises(wh.SplitError, match=r"model.layers.0.mlp.*dim_size of LlamaMLP"):
            wh.plan_model(_annotate(_llama(), {"model": "llama"}), 2)
        assert splitrules.split_rule_for(LlamaMLP) is mine  # loading whale.parallel.split_hf keeps it
    finally:
        splitrules._RULES.pop(LlamaMLP, None)
        splitrules._DIM_SIZES.pop(LlamaMLP, None)
        if saved[0] is not None:
            splitrules._register_builtin(LlamaMLP, saved[0])
        elif "whale.parallel.split_hf" in splitrules._LOADED:
            from whale.parallel.split_hf import shard_llama_mlp

            splitrules._register_builtin(LlamaMLP, shard_llama_mlp)
