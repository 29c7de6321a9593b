"""Legal plans only (issue 28, part 3): split degrees divide heads, kv heads, hidden, FFN and vocab; split groups
stay inside a node unless allowed, and are then costed on the inter-node link; the micro-batch count is bounded
by the batch, not by a constant; the embedding and LM head are vocab-parallel in the model's cost."""

from __future__ import annotations

import pytest

from whale.cluster import CATALOG
from whale.planner.gpt import GPTShape
from whale.planner.legality import check_split, legal_split_degrees, split_blockers
from whale.planner.memory import MemoryOptions
from whale.planner.model_desc import transformer
from whale.planner.roofline import Roofline
from whale.planner.search import Candidate, Constraints, enumerate_candidates
from whale.planner.steptime.estimate import DefaultEstimator, DevicePool
from whale.planner.transformer_estimate import TransformerEstimator

A100 = CATALOG["A100-80GB"]


def pool(n: int, per_node: int = 8) -> DevicePool:
    return DevicePool((A100,), (n,), (80e9,), (250e9,), per_node, 300e9, 25e9, 1e-5, (), "bf16", ())


def splits(est, n_layers: int, n: int, batch: int, **cons) -> set[int]:
    cands = enumerate_candidates(n_layers, (n,), batch, Constraints(**cons), est.cuts, est.split_ok, (80e9,))
    return {c.split for c in cands}


def test_split_degree_7_is_never_chosen_for_128_heads():
    """56 GPUs on 7-GPU nodes: 7 divides the devices and the node but neither 128 heads nor hidden 16384."""
    desc = transformer(4, 16384, 256, 51200, heads=128)
    est = DefaultEstimator(desc, pool(56, per_node=7), 56)
    got = splits(est, len(desc.layers), 56, 56, stages=1)
    assert 7 not in got and 7 * 8 not in got and got <= {1}  # only t = 1 divides both 7-GPU nodes and 128 heads
    est8 = DefaultEstimator(desc, pool(64), 64)
    assert splits(est8, len(desc.layers), 64, 64, stages=1) == {1, 2, 4, 8}


def test_gpt_legality_names_the_dimension():
    sh = GPTShape(8, 5120, 40, vocab=50257)
    assert split_blockers(sh, 8) == ["vocab=50257"]
    with pytest.raises(ValueError, match="vocab=50257"):
        check_split(sh, 8, 8)
    ok = GPTShape(128, 25600, 160)
    assert legal_split_degrees(ok, 3072, 8) == [1, 2, 4, 8]
    assert 16 in legal_split_degrees(ok, 3072, 8, cross_nodes=True)
    with pytest.raises(ValueError, match="spans nodes"):
        check_split(ok, 16, 8)


def test_cross_node_split_only_when_allowed_and_on_the_inter_node_link():
    sh = GPTShape(16, 8192, 64)
    roof = (Roofline.of(A100, 0.6),)
    inside = TransformerEstimator(sh, pool(32), 32, roof)
    across = TransformerEstimator(sh, pool(32), 32, roof, cross_nodes=True)
    n = len(inside.model.layers)
    assert max(splits(inside, n, 32, 32, stages=1)) == 8
    assert 16 in splits(across, n, 32, 32, stages=1)
    assert across._link(16, "allreduce")[0] == 25e9 and across._link(8, "allreduce")[0] == 300e9
    c = lambda t: Candidate(32 // t, 1, t, 1, "1F1B", MemoryOptions(True), (n,), ((32,),))  # noqa: E731
    e8, e16 = across(c(8)), across(c(16))
    fwd8, fwd16 = e8.detail["stage_forward_seconds"][0], e16.detail["stage_forward_seconds"][0]
    assert fwd16 > fwd8  # half the compute per device, but every all-reduce crosses InfiniBand


def test_micro_batch_count_bounded_by_the_batch():
    """The 1T plan's 512 micro-batches (batch 3072, 6 data-parallel lanes) are in the space by default."""
    desc = GPTShape(128, 25600, 160).model_desc()
    est = DefaultEstimator(desc, pool(3072), 3072)
    cands = enumerate_candidates(len(desc.layers), (3072,), 3072, Constraints(stages=64, split=8), est.cuts,
                                 est.split_ok, (80e9,))
    ms = {c.num_micro_batch for c in cands}
    assert 512 in ms and max(ms) == 512  # 3072 / 6 lanes: every lane keeps one row per micro-batch
    capped = enumerate_candidates(len(desc.layers), (3072,), 3072, Constraints(stages=64, split=8, max_micro_batch=64),
                                  est.cuts, est.split_ok, (80e9,))
    assert max(c.num_micro_batch for c in capped) == 64


def test_vocab_parallel_embedding_and_head():
    """The head's compute and the embedding's parameters are divided by the split degree."""
    sh = GPTShape(4, 8192, 64)
    est = TransformerEstimator(sh, pool(8), 8, (Roofline.of(A100, 0.6),))
    n = len(est.model.layers)
    f1, b1 = est._seconds(n - 1, n, 1, 0, 1, False)
    f8, b8 = est._seconds(n - 1, n, 8, 0, 1, False)
    assert f1 / f8 == pytest.approx(8, rel=0.1) and b1 / b8 == pytest.approx(8, rel=0.1)
    assert est._stage(0, 1, 8).elements == pytest.approx((51200 + 2048) * 8192 / 8)
    generic = DefaultEstimator(sh.model_desc(), pool(8), 8)
    assert generic._stage(n - 1, n, 8).train == pytest.approx(generic._stage(n - 1, n, 1).train / 8)
