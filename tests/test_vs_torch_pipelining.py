"""benchmarks/vs_torch_pipelining.py on 2 ranks with a tiny config: Whale and torch.distributed.pipelining
compute the same first-step loss from the same initial weights, for GPipe, 1F1B, interleaved 1F1B and zero-bubble,
and the JSON report has its fields, with both frameworks' idle shares per stage. No speed assertion: speed is the
benchmark's to report (benchmarks/results/vs_torch_pipelining.json).
"""

from __future__ import annotations

import json

from tests.distributed import run_ranks

ARGV = ["--tiny-dim", "16", "--tiny-rows", "8", "--dim", "32", "--rows", "8", "--steps", "4", "--block", "2",
        "--warmup", "1"]


def _worker(rank, world, args):
    from benchmarks import vs_torch_pipelining

    return vs_torch_pipelining.worker(rank, world, args)


def test_whale_and_torch_pipelining_agree(tmp_path):
    from benchmarks import vs_torch_pipelining

    args = vs_torch_pipelining.parse_args(ARGV + ["--out", str(tmp_path / "out.json")])
    results = run_ranks(_worker, 2, args, timeout=120)[0]
    report = vs_torch_pipelining.report(results, args)
    assert [(r["dim"], r["schedule"]) for r in results] == [(d, s) for d in (16, 32)
                                                           for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZB-H1")]
    for r in results:
        assert abs(r["first_loss_whale"] - r["first_loss_torch"]) <= 1e-5 * abs(r["first_loss_torch"])
        assert len(r["losses_whale"]) == len(r["losses_torch"]) == 6  # (1 warm-up + 2 timed) blocks of 2 steps each
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["args"]["micro_batches"] == 4
    for r in saved["results"]:
        for key in ("whale_step_s", "torch_step_s", "throughput_ratio_vs_torch_pipelining", "first_loss_whale",
                    "first_loss_torch", "first_loss_rel_diff", "goal_met", "raw_step_s", "throughput_ratio_iqr",
                    "whale_idle_share", "theory_idle_share"):
            assert key in r
        assert r["whale_step_s"] > 0 and r["torch_step_s"] > 0
        for share in r["whale_idle_share"] + r["torch_idle_share"]:  # both frameworks' compute was timed
            assert 0.0 <= share < 1.0
        assert r["whale_minus_torch_idle"] == [a - b for a, b in zip(r["whale_idle_share"], r["torch_idle_share"],
                                                                     strict=True)]
        assert len(r["raw_step_s"]["whale"]) == len(r["raw_step_s"]["torch"]) == 2  # seconds per step, per block
