"""Sequence parallelism in split regions (whale.parallel.seqpar) against one process, dropout included.

The GPT example's blocks under ``wh.split`` (rule: examples/gpt/tensor_parallel.py), trained with
``Config(sequence_parallel=True)`` on gloo ranks, against a ``deepcopy`` trained by plain PyTorch in one
process: losses every step, every parameter after the steps (the consolidated model), fp32, rtol 1e-5 /
atol 1e-6 (3 steps of SGD, lr 0.5, momentum 0.9: linear in the gradient, so a wrong gradient scale shows, where
Adam would hide it; and Adam turns the rounding noise of near-zero gradients, summed in another order over the
replicas, into update differences of ~1e-5). The residual and MLP dropouts are on (p = 0.2): the reference draws each
block's masks from the stream a split region uses (``("group", seed, stage, replica, region)``, re-seeded per
step, :mod:`whale.runtime.rng`) over the replica's rows, so equality proves that the sequence shards' masks,
put together, are the one-process mask of the whole tensor. The reference runs the replicas' rows one after
another (the token-mean loss over the global batch is the sum of their parts).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import examples.gpt.tensor_parallel  # noqa: F401 - registers the GPT block's split rule
import whale as wh
from examples.gpt.model import GPT, GPTConfig
from tests.distributed import run_ranks
from whale.parallel.seqpar import SeqDropout, SequenceParallelRegion
from whale.parallel.split_ops import comm_bytes
from whale.runtime.rng import Stream

RTOL, ATOL, STEPS, SEED = 1e-5, 1e-6, 3, 0


def _model(width: int | None, seq: int = 8, stages: int = 1) -> GPT:
    cfg = GPTConfig(vocab_size=40, block_size=seq, n_layer=2, n_head=4, n_embd=16, dropout=0.2, attn_dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg, stages=stages, stage_width=width, split_blocks=True)
    model.drop.p = 0.0  # the embedding dropout runs outside the split regions, on each lane's own stream
    return model


def _batches(seq: int = 8, batch: int = 8):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 40, (batch, seq), generator=g)
        out.append((x, torch.roll(x, 1, dims=1)))
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _region_keys(plan) -> dict[str, tuple[int, int]]:
    """Block FQN -> (stage, index of its region in the stage), as the split runtime numbers regions."""
    return {name: (stage, i) for stage in range(plan.num_stages)
            for i, (name, _) in enumerate(plan.split_targets(stage))}


def _reference_step(ref, opt, x, y, plan, step: int) -> float:
    """One process: each replica's rows, micro-batch after micro-batch, through the blocks on that replica's
    region streams (a stream runs on through the step's micro-batches, as in the engine)."""
    width, rows, keys = plan.stage_width, plan.micro_batch_rows(len(x)), _region_keys(plan)
    opt.zero_grad()
    total = 0.0
    for r in range(plan.num_replicas):
        handles = []
        for i, block in enumerate(ref.blocks):
            stage, index = keys[f"blocks.{i}"]
            s = Stream([torch.default_generator], ("group", SEED, stage, r, index), lambda: step)
            handles += [block.register_forward_pre_hook(lambda m, args, s=s: s.enter(m.training)),
                        block.register_forward_hook(lambda m, args, out, s=s: s.exit())]
        for m in range(plan.num_micro_batch):
            a, b = rows[r * width][m][0], rows[(r + 1) * width - 1][m][1]
            loss = F.cross_entropy(ref(x[a:b]).flatten(0, 1), y[a:b].flatten(), reduction="sum") / y.numel()
            loss.backward()
            total += loss.item()
        for h in handles:
            h.remove()
    opt.step()
    return total


def _train(rank, world, spec):
    ctx = wh.init(wh.Config(seed=SEED, sequence_parallel=spec["sp"], num_micro_batch=spec.get("mb", 1),
                            capture=spec.get("capture", "auto")))
    model = _model(spec.get("width"), stages=spec.get("stages", 1))
    ref = copy.deepcopy(model)
    sample = _batches()[0] if spec.get("capture") == "export" else None
    engine = wh.parallelize(model, wh.token_cross_entropy(), _sgd, ctx=ctx, sample_batch=sample)
    ref_opt = _sgd(ref.parameters())
    comm_bytes.clear()
    losses, ref_losses = [], []
    for step, (x, y) in enumerate(_batches()):
        losses.append(engine.step((x, y))["loss"])
        ref_losses.append(_reference_step(ref, ref_opt, x, y, engine.plan, step))
    full = engine.full_state_dict()
    if rank == 0:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        ref_state = ref.state_dict()
        assert set(full) == set(ref_state)
        for name, t in ref_state.items():
            torch.testing.assert_close(full[name], t, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    kinds = [type(r).__name__ for r in engine.split.regions]
    dropouts = sum(isinstance(m, SeqDropout) for r in engine.split.regions for m in r.modules())
    return {"losses": losses, "regions": kinds, "dropouts": dropouts, "plan": engine.plan.to_json(),
            "comm": dict(comm_bytes)}


@pytest.mark.parametrize("world,width", [(2, None), (4, None), (4, 2)])
def test_sequence_parallel_matches_one_process_with_dropout(world, width):
    results = run_ranks(_train, world, {"sp": True, "width": width}, timeout=240)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.sequence_parallel and plan.stage_width == (width or world)
    assert plan.num_replicas == world // (width or world)
    for r in results:
        assert r["regions"] == [SequenceParallelRegion.__name__] * 2 and r["dropouts"] == 4
        assert r["comm"]["reduce_scatter"] > 0 and r["losses"] == results[0]["losses"]


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_sequence_parallel_inside_pipeline_stages_matches_one_process(capture):
    """Two pipeline stages of split 2 (one block each), 2 micro-batches, the tied embedding / head across the
    stages; both graph captures (two split blocks in a row are two single calls)."""
    spec = {"sp": True, "width": 2, "stages": 2, "mb": 2, "capture": capture}
    results = run_ranks(_train, 4, spec, timeout=240)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert plan.num_stages == 2 and plan.leaf_modules == ("blocks.0", "blocks.1")
    assert all(r["regions"] == [SequenceParallelRegion.__name__] for r in results)


def test_plain_tensor_parallel_block_matches_one_process_with_dropout():
    """The same rule without sequence parallelism: replicated activations, all-reduces, nn.Dropout on the group
    stream (one mask over the group: the one-process mask of the whole tensor)."""
    results = run_ranks(_train, 2, {"sp": False}, timeout=240)
    assert results[0]["regions"] == ["SplitRegion"] * 2 and "reduce_scatter" not in results[0]["comm"]


def _indivisible(rank, world):
    ctx = wh.init(wh.Config(seed=SEED, sequence_parallel=True))
    engine = wh.parallelize(_model(None, seq=9), wh.token_cross_entropy(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                            ctx=ctx)
    x = torch.randint(0, 40, (4, 9))
    with pytest.raises(wh.SplitError) as err:
        engine.step((x, x))
    return str(err.value)


def test_indivisible_sequence_length_is_refused_in_one_line():
    msgs = run_ranks(_indivisible, 2, timeout=120)
    for msg in msgs:
        assert "\n" not in msg and "divisible by 2, got 9" in msg and "multiple of 2" in msg


def _no_sp_rule(rank, world):
    ctx = wh.init(wh.Config(seed=SEED, sequence_parallel=True))
    model = torch.nn.Sequential()
    with wh.replicate():
        model.append(torch.nn.Linear(4, 8))
    with wh.split():
        model.append(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
    with pytest.raises(wh.SplitError, match="no split module of stage 0 has a sequence-parallel shard"):
        wh.parallelize(model, torch.nn.MSELoss(), lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    return True


def test_sequence_parallel_without_a_supporting_rule_is_refused():
    assert run_ranks(_no_sp_rule, 2, timeout=120) == [True, True]


def _dropout_pieces(rank, world):
    torch.manual_seed(11)  # the same generator state on every rank, as a region's group stream gives
    seq = 8
    shard = torch.ones(2, seq, 3)[:, rank * seq // world:(rank + 1) * seq // world]
    return SeqDropout(0.3).train()(shard).tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_shards_of_dropout_are_the_one_process_mask(world):
    pieces = run_ranks(_dropout_pieces, world, timeout=120)
    torch.manual_seed(11)
    whole = F.dropout(torch.ones(2, 8, 3), 0.3, training=True)
    assert torch.equal(torch.cat([torch.tensor(p) for p in pieces], dim=1), whole)


def test_split_gpt_block_refuses_attention_dropout_and_moe():
    from examples.gpt.model import Block
    from examples.gpt.tensor_parallel import shard_block

    with pytest.raises(wh.SplitError, match="attention dropout 0.1 cannot match one process.*attn_dropout=0"):
        shard_block(Block(GPTConfig(n_embd=16, n_head=4, dropout=0.1)), None)
    with pytest.raises(wh.SplitError, match="shards a dense MLP, got MoE"):
        shard_block(Block(GPTConfig(n_embd=16, n_head=4, moe_experts=2), moe_parallel=False), None)
