"""Memory (issue 12): Config / Plan fields, choosing checkpointed modules, the storage tracker, checkpointing of
eager modules and of fx / torch.export stage graphs (dropout masks identical on recompute), the memory table.
The distributed checks (DP x PP equivalence, measured activation drop, emulated out-of-memory) are in
tests/test_memory_distributed.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import whale as wh
from examples.gpt.model import GPT, GPTConfig
from whale.config import ConfigError
from whale.frontend.export import capture_inputs
from whale.frontend.stagecut import capture
from whale.memory.checkpointing import CheckpointError, apply_checkpointing, resolve_targets, unwrap
from whale.memory.monitor import EmulatedOutOfMemoryError, format_memory_table
from whale.memory.tracker import StorageTracker
from whale.plan.plan import Plan, PlanError, TaskGraph


def gpt(dropout: float = 0.1, layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=16, dropout=dropout))


def test_config_normalises_and_refuses_checkpoint_specs():
    assert wh.Config().activation_checkpoint == ()
    assert wh.Config(activation_checkpoint="all").activation_checkpoint == "all"
    assert wh.Config(activation_checkpoint=nn.Linear).activation_checkpoint == ("Linear",)
    assert wh.Config(activation_checkpoint=["blocks.*", 1]).activation_checkpoint == ("blocks.*", 1)
    for bad in ("Block", ("",), (-1,), (True,), (None,), ("all", "x")):
        with pytest.raises(ConfigError, match="activation_checkpoint"):
            wh.Config(activation_checkpoint=bad)
    with pytest.raises(ConfigError, match="track_memory"):
        wh.Config(track_memory="yes")
    assert wh.Config(activation_checkpoint=("Block",)).to_dict()["activation_checkpoint"] == ["Block"]


def test_plan_records_checkpointing_and_prediction_as_plain_data():
    tg = TaskGraph(0, "replicate", 2, num_params=10)
    plan = Plan(2, (tg,), 1, activation_checkpoint=("blocks.0", "blocks.1"), predicted_memory=(5.0, 6.0))
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="inside it"):
        Plan(2, (tg,), 1, activation_checkpoint=("blocks", "blocks.1"))
    with pytest.raises(PlanError, match="whole model"):
        Plan(2, (tg,), 1, activation_checkpoint=("",))
    with pytest.raises(PlanError, match="predicted_memory"):
        Plan(2, (tg,), 1, predicted_memory=(1.0,))


def test_resolve_targets_by_all_type_glob_and_task_graph():
    m = gpt()
    assert resolve_targets(m, "all") == ("blocks.0", "blocks.1")
    assert resolve_targets(m, ("Block",)) == ("blocks.0", "blocks.1")
    assert resolve_targets(m, ("blocks.1.*", "MLP")) == ("blocks.0.mlp", "blocks.1.ln_1", "blocks.1.attn",
                                                          "blocks.1.ln_2", "blocks.1.mlp")
    tgs = (TaskGraph(0, "replicate", 1, ("tok_emb", "blocks.0")), TaskGraph(1, "replicate", 1, ("blocks.1",)))
    assert resolve_targets(m, (1,), tgs, units=("tok_emb", "blocks.0", "blocks.1")) == ("blocks.1",)
    with pytest.raises(CheckpointError, match="matches no module.*Block"):
        resolve_targets(m, ("Blok",))
    with pytest.raises(CheckpointError, match="TaskGraph 5"):
        resolve_targets(m, (5,), tgs)
    with pytest.raises(CheckpointError, match="split module 'blocks.0.mlp.c_fc'"):
        resolve_targets(m, ("Block",), split_targets=("blocks.0.mlp.c_fc",))


def test_plan_model_resolves_the_config():
    plan = wh.plan_model(gpt(), 1, wh.Config(activation_checkpoint="all"))
    assert plan.activation_checkpoint == ("blocks.0", "blocks.1")
    assert "activation checkpointing" in str(plan)


def test_tracker_counts_live_storage_by_category_and_peak():
    tr = StorageTracker()
    w = torch.zeros(256)  # made outside: counted once labelled
    tr.label(w, "parameters")
    with tr:
        a = torch.ones(1024)  # 4 KiB activation
        b = a * 2  # another 4 KiB
        v = b[:10]  # a view: no new storage
        del a, b
        peak = tr.peak
        c = torch.ones(512)
    assert peak == 1024 + 2 * 4096
    assert tr.current == {**dict.fromkeys(tr.current, 0), "parameters": 1024, "activations": 4096 + 2048}
    assert tr.category_peaks["activations"] == 8192 and tr.at_peak["activations"] == 8192
    del v, c
    assert tr.current["activations"] == 0
    with pytest.raises(ValueError, match="unknown memory category"):
        tr.label(w, "weights")


@pytest.mark.parametrize("how", ["eager", "fx", "export"])
def test_checkpointing_keeps_outputs_gradients_and_dropout_masks(how):
    model = gpt(dropout=0.2)
    x = torch.randint(0, 64, (4, 16))
    if how == "eager":
        run, ref_model = model, copy.deepcopy(model)
    else:
        run = capture(model, (), capture_inputs(x) if how == "export" else ()).train
        ref_model = copy.deepcopy(run)

    def fwd_bwd(m):
        torch.manual_seed(3)
        out = m(x)
        out.float().pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters()]

    ref_out, ref_grads = fwd_bwd(ref_model)
    assert apply_checkpointing(run, resolve_targets(model, "all")) == 2
    out, grads = fwd_bwd(run)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    if how == "eager":
        unwrap(model)
        assert "forward" not in model.blocks[0].__dict__


def test_checkpointed_stage_graph_keeps_its_parameter_names_and_runs_in_eval():
    model = gpt()
    gm = capture(model, (), ()).train
    names = [n for n, _ in gm.named_parameters()]
    apply_checkpointing(gm, ("blocks.0",))
    assert [n for n, _ in gm.named_parameters()] == names
    assert "whale_checkpoint_0" in gm.code
    with torch.no_grad():
        gm(torch.zeros(2, 16, dtype=torch.long))


def test_memory_table_and_oom_message():
    row = {"rank": 0, "stage": 0, "lane": 0, "device": "V100-32GB", "steps": 2, "peak_bytes": 3 * 2**20,
           "at_peak": {"parameters": 2**20, "activations": 2 * 2**20}, "category_peaks": {"activations": 2**21},
           "capacity_bytes": 2**22, "predicted_bytes": 1.5 * 2**20}
    table = format_memory_table([row])
    assert "peak MiB" in table and "3.00" in table and "0.50" in table
    assert "not measured" in format_memory_table([{**row, "steps": 0}])
    err = EmulatedOutOfMemoryError([(1, "P100-16GB", 5 * 2**20, 2**22, 3 * 2**20)])
    assert "rank 1 (P100-16GB) needed 5.0 MiB" in str(err) and "has 4.0 MiB" in str(err)
    assert "predicted 3.0 MiB" in str(err)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_checkpointing_hugging_face_layers_eager_and_exported(kind):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=8,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        model, layers = transformers.GPT2LMHeadModel(cfg), ("transformer.h.0", "transformer.h.1")
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                       max_position_embeddings=8, attention_dropout=0.1)
        model, layers = transformers.LlamaForCausalLM(cfg), ("model.layers.0", "model.layers.1")
    inputs = {"input_ids": torch.randint(0, 64, (4, 8)), "use_cache": False}
    assert resolve_targets(model, "all") == layers
    for how in ("eager", "export"):
        run = model if how == "eager" else capture(model, (), capture_inputs(inputs)).train
        ref = copy.deepcopy(run)

        def fwd_bwd(m):
            torch.manual_seed(3)
            out = m(**inputs).logits
            out.pow(2).mean().backward()
            return out.detach(), [p.grad.clone() for p in m.parameters()]

        ref_out, ref_grads = fwd_bwd(ref)
        assert apply_checkpointing(run, layers) == 2
        out, grads = fwd_bwd(run)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
        model.zero_grad()
