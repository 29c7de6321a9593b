"""Hardware-aware virtual stages on an emulated mixed cluster: the planner re-cuts the interleaved chunks by
device speed (uneven units per chunk, fast devices holding more), the printout shows every rank's chunks, and
the run trains to the same losses and parameters as one process (fp32, rtol 1e-5 / atol 1e-6; gloo ranks of
:mod:`tests.distributed`, CPU ranks imitating the declared V100 / P100 speeds)."""

from __future__ import annotations

import copy

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, lm_loss, lm_side_by_side
from whale.cluster import ClusterSpec

_NODES = {2: [{"devices": ["P100-16GB", "V100-32GB"]}],
          4: [{"devices": ["V100-32GB", "V100-32GB"]}, {"devices": ["P100-16GB", "P100-16GB"]}]}


def _cluster(world: int) -> ClusterSpec:
    return ClusterSpec.from_dict({"emulate": True, "nodes": _NODES[world]})


def _config(world: int) -> wh.Config:
    return wh.Config(num_micro_batch=4, schedule="Interleaved1F1B", virtual_stages=2, seed=0,
                     cluster=_cluster(world))


def _model() -> TinyLM:
    return TinyLM(stage_layers=(1, 1, 1, 1), d=32, tied=True)  # 4 chunk scopes: p = 2, v = 2; 4 blocks


def _train(rank, world):
    """Whale on the emulated cluster against a one-process deepcopy (AdamW, 3 steps)."""
    ctx = wh.init(_config(world))
    model = _model()
    ref = copy.deepcopy(model)
    x0, y0 = next(iter(lm_batches(1, 8)))
    engine = wh.parallelize(model, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx,
                            sample_batch=(x0, y0))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = lm_side_by_side(engine, ref, ref_opt, 3, 8)
    full = engine.full_state_dict()
    diff = max((full[n] - v).abs().max().item() for n, v in ref.state_dict().items()) if rank == 0 else 0.0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in (ref.state_dict().items() if rank == 0 else ()):
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return {"plan": engine.plan.to_json(), "labels": sorted(t[0] for t in engine.last_timeline),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), "param_diff": diff}


@pytest.mark.parametrize("world", [2, 4])
def test_hardware_aware_chunks_match_one_process(world):
    results = run_ranks(_train, world, timeout=180)
    plan = wh.Plan.from_json(results[0]["plan"])
    assert (plan.num_stages, plan.virtual_stages, plan.num_chunks) == (2, 2, 4)
    assert any(n.startswith("interleaved placement") for n in plan.notes)
    assert all(cut.units for cut in plan.stage_cuts)
    for r in results:
        assert r["labels"] == sorted(f"{k}{i}" + (f"c{c}" if c else "") for k in "FB" for c in range(2)
                                     for i in range(4))
    print(f"world {world}: max |loss diff| {max(r['loss_diff'] for r in results):.2e}, "
          f"max |param diff| {results[0]['param_diff']:.2e}")


def test_the_planner_gives_the_fast_device_more_work_and_prints_chunks_per_rank():
    """World 2, V100 + P100: the V100's position holds more blocks than the P100's; the device table lists
    each rank's chunks and their units."""
    x, y = next(iter(lm_batches(1, 8)))
    plan = wh.plan_model(TinyLM(stage_layers=(2, 2, 2, 2), d=32), 2, _config(2), sample_batch=(x, y),
                         loss_fn=lm_loss)
    blocks = [sum(u.startswith("blocks.") for c in range(s, 4, 2) for u in plan.stage_cuts[c].units)
              for s in range(2)]
    fast = plan.coords(1)[0]  # rank 1 is the V100
    assert blocks[fast] > blocks[1 - fast] and sum(blocks) == 8
    text = str(plan)
    assert "chunks (units)" in text and "interleaved placement" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("1 V100-32GB"))
    assert f"{fast} (" in row and f"{fast + 2} (" in row
