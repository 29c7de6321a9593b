"""Expert parallelism + mixed precision + granular CPU offload (ExpertOffloadEstimator) and the Whale paper's 10T
plan (benchmarks/paper_10t.py): fits with offload, not without, and not in the default host memory."""

from __future__ import annotations

import pytest

from benchmarks.paper_10t import BATCH, cluster, model
from whale.cluster import ClusterSpec, NodeSpec, get_device_type
from whale.planner.memory_types import MemoryOptions
from whale.planner.model_desc import LayerDesc, ModelDesc
from whale.planner.search import Candidate, Constraints, NoFeasiblePlanError
from whale.planner.steptime.estimate import plan_search, pool_from_cluster
from whale.planner.steptime.expert_offload import ExpertOffloadEstimator


def _search(spec, forbid=()):
    desc, pool = model(), pool_from_cluster(spec, "fp16")
    return plan_search(desc, pool, BATCH, Constraints(forbid=forbid), estimator=ExpertOffloadEstimator(desc, pool,
                                                                                                      BATCH))


def test_10t_fits_with_offload_within_device_and_declared_host_memory():
    res = _search(cluster())
    e = res.best.estimate
    assert res.best.candidate.options.offload != "none"
    assert e.fits and max(e.peak_bytes) <= 32e9
    per_node = max(e.host_bytes) * 8
    assert per_node <= cluster().nodes[0].host_memory_bytes
    # the whole model's optimizer state lives on the hosts: 14 bytes per parameter over 64 nodes, at least
    assert per_node * 64 >= 14 * model().params * 0.99
    assert 0 < e.step_seconds < float("inf")


def test_10t_does_not_fit_without_offload_and_names_the_shortfall():
    with pytest.raises(NoFeasiblePlanError) as err:
        _search(cluster(), forbid=("offload",))
    assert "of device memory" in str(err.value) and err.value.lacking_bytes > 32e9


def test_10t_does_not_fit_the_default_host_memory():
    with pytest.raises(NoFeasiblePlanError) as err:
        _search(cluster(None))  # DGX-1 default: 512 GB per node
    assert "of host memory" in str(err.value)


def _tiny(experts: int = 6):
    dense = LayerDesc("attn", 3e6, 1000, 10.0, 4.0, "attention")
    moe = LayerDesc("moe", 6e6, 8 * 100 * experts + 8, 20.0, 4.0, "moe", experts, 1, 8 * 100 * experts)
    desc = ModelDesc((dense, moe))
    v = get_device_type("V100-32GB")
    pool = pool_from_cluster(ClusterSpec(tuple(NodeSpec((v,) * 4) for _ in range(1))), "fp16")
    return desc, ExpertOffloadEstimator(desc, pool, 8)


@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+params"])
def test_bytes_by_hand_on_uneven_experts(offload):
    desc, est = _tiny(experts=6)  # 6 experts over d=4 lanes: the fullest device holds 2 of them
    c = Candidate(4, 1, 1, 1, "1F1B", MemoryOptions(False, 0, offload), (2,), ((4,),))
    b = est.breakdown(c, 0, 2)
    rep = 1000 + 8  # attention + the gate, replicated
    exp = 2 * 800  # two experts of 800 elements
    held = {"optimizer+params": 2 * max(1000, 8 + exp)}.get(offload, rep + exp)
    assert b["parameters"] == b["gradients"] == 2 * held
    assert b["optimizer_state"] == (12 * (rep + exp) if offload == "none" else 0)
    assert b["host"] == (0 if offload == "none" else 14 * (rep + exp))
    assert b["activations"] == 2 * (10.0 + 20.0)
    assert est.memory(c).peak_bytes[0] == pytest.approx(sum(v for k, v in b.items() if k != "host"))


def test_zero_shards_only_the_replicated_state():
    desc, est = _tiny(experts=8)
    c = Candidate(4, 1, 1, 1, "1F1B", MemoryOptions(False, 1, "optimizer"), (2,), ((4,),))
    assert est.breakdown(c, 0, 1)["host"] == 14 * (1008 / 4 + 2 * 800)
