"""Config(auto=True) searches split degrees on the example GPT (whale.frontend.autosplit), legal ones only,
process-free: split is chosen where it is the fastest plan and not where data parallelism is."""

from __future__ import annotations

import pytest
import torch

import examples.gpt.tensor_parallel  # noqa: F401  (registers the Block split rule)
import whale as wh
from examples.gpt.model import GPT, GPTConfig
from whale.cluster import ClusterSpec, NodeSpec, get_device_type
from whale.frontend.autoplan import auto_layout
from whale.loss import token_cross_entropy


@pytest.fixture(autouse=True)
def _datasheet_costs(monkeypatch, tmp_path):
    """No cached calibration: the datasheet estimator ranks (the machine's cache would change the costs)."""
    monkeypatch.setenv("WHALE_CALIBRATION", str(tmp_path / "calibration.json"))


def _layout(batch: int, n_embd: int, per_node: int, nodes: int = 1, n_head: int = 4):
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=n_head, n_embd=n_embd))
    x = torch.zeros(batch, 16, dtype=torch.long)
    v100 = get_device_type("V100-32GB")
    spec = ClusterSpec(tuple(NodeSpec((v100,) * per_node) for _ in range(nodes)))
    cfg = wh.Config(auto=True, cluster=spec)
    return auto_layout(model, per_node * nodes, cfg, (x, x), None, token_cross_entropy())


def test_split_chosen_when_gradient_sync_dominates():
    got = _layout(batch=2, n_embd=2048, per_node=2)  # 100M parameters, 2 rows: split beats data parallel
    best = got.result.best.candidate
    assert best.split == 2 and best.data_parallel == 1
    kinds = [s.kind for s in got.tg_scopes]
    assert kinds == ["replicate", "split", "split", "replicate"]
    assert any("runner-up" in n for n in got.notes)


def test_split_not_chosen_when_data_parallel_is_faster():
    got = _layout(batch=256, n_embd=64, per_node=4)
    assert got.result.best.candidate.split == 1


def test_only_legal_split_degrees_inside_a_node():
    got = _layout(batch=2, n_embd=2048, per_node=4, nodes=2, n_head=2)  # 2 heads: split 4 or 8 is illegal
    seen = {r.candidate.split for r in [got.result.best, *got.result.runner_ups]}
    assert seen <= {1, 2}
