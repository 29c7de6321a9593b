"""benchmarks/heterogeneous.py on a tiny EMULATED 2-rank cluster: the benchmark runs end to end and reports
what it promises.

The cluster (benchmarks/clusters/test_slow3x.yaml) pairs a V100 with a custom device 3x slower. The shares the
plan gives are asserted exactly; measured speeds are not (they depend on the host's load: the benchmark itself
reports them, ``benchmarks/results/heterogeneous.json``).
"""

from __future__ import annotations

import importlib
import os
import sys

from tests.distributed import run_ranks

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
CFG = {"spec": "test_slow3x.yaml", "batch": 40, "tokens": 256, "dim": 64, "layers": 2, "warmup": 1, "rounds": 2,
       "k": 2, "window_s": 0.5}


def _bench():
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module("heterogeneous")


def _dp_compare(rank, world, cfg):
    return _bench().dp_compare(rank, world, cfg)


def test_hardware_aware_shares_beat_equal_shares():
    result = run_ranks(_dp_compare, 2, CFG, timeout=90)[0]
    assert result["devices"] == ["V100-32GB", "SLOW3X"]
    assert result["slowdown"][0] == 0.0 and result["slowdown"][1] > 0  # the 3x slower device is slowed
    assert result["equal"]["rows"] == [20, 20]
    assert result["aware"]["rows"] == [30, 10]
    assert result["equal"]["step_s"] > 0 and result["aware"]["step_s"] > 0
    assert [s["device"] for s in result["standalone"]] == ["V100-32GB", "SLOW3X"]
    for s in result["standalone"]:
        for mode in ("job_rows", "equal_rows", "idle_host"):
            assert s[mode]["throughput"] > 0 and len(s[mode]["times"]) == CFG["rounds"]
    assert [s["job_rows"]["rows"] for s in result["standalone"]] == [30, 10]
    assert "EMULATED" in result["aware"]["plan"]


def test_pipeline_analysis_is_exact_on_a_known_case():
    from benchmarks import _hetero_model as analysis

    bench = _bench()
    fwd, bwd = [1.0] * 6, [2.0] * 6
    # speeds 2:1 -> the best contiguous cut gives the fast stage 4 layers, the slow one 2
    assert analysis.best_cut(fwd, bwd, 0.0, 0.0, [2.0, 1.0]) == [4, 2]
    assert analysis.bottleneck([3, 3], fwd, bwd, 0.0, 0.0, [2.0, 1.0]) == 9.0
    # 1F1B on equal stages: (m + S - 1) x (f + b)
    assert analysis.simulate_1f1b([1.0, 1.0], [2.0, 2.0], 4) == (4 + 2 - 1) * 3.0
    assert abs(bench.ideal_dp_speedup([15.7e12, 10.6e12]) - 1.2406) < 1e-3
