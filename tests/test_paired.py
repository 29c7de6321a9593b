"""The paired-timing helper's order and statistics (``benchmarks/_paired.py``), process-free."""

from __future__ import annotations

import json

import pytest

from benchmarks import _paired, _provenance


def test_abba_order_alternates():
    assert _paired.abba(4) == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]


def test_rounds_discards_warmup_and_runs_in_abba_order():
    calls, clock = [], iter(range(1, 100))

    def timer(name):
        def f():
            calls.append(name)
            return float(next(clock))
        return f

    a, b = _paired.rounds(timer("a"), timer("b"), n_rounds=3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert a == [4.0, 5.0, 8.0] and b == [3.0, 6.0, 7.0]  # round 1 ran B (3) then A (4)
    with pytest.raises(ValueError):
        _paired.rounds(timer("a"), timer("b"), n_rounds=0)


def test_summary_is_the_median_of_paired_ratios_with_iqr():
    a = [1.0, 2.0, 1.0, 2.0, 1.0]
    b = [1.1, 2.4, 0.9, 2.2, 1.0]  # ratios 1.1, 1.2, 0.9, 1.1, 1.0
    s = _paired.summary(a, b, goal=1.0)
    assert s["ratios"] == pytest.approx([1.1, 1.2, 0.9, 1.1, 1.0])
    assert s["median"] == pytest.approx(1.1) and s["n"] == 5
    assert s["q1"] == pytest.approx(1.0) and s["q3"] == pytest.approx(1.1)
    assert (s["min"], s["max"]) == pytest.approx((0.9, 1.2))
    assert s["goal_met"] is True  # the whole IQR [1.0, 1.1] is >= 1.0
    assert _paired.summary(a, b, goal=1.05)["goal_met"] == "unclear"
    assert _paired.summary(a, b, goal=1.15)["goal_met"] is False
    assert _paired.summary(a, b, goal=1.15, higher_is_better=False)["goal_met"] is True
    json.dumps(s)  # JSON-ready


def test_median_unmoved_by_drift_that_hits_both_alike():
    drift = [1.0, 3.0, 0.5, 8.0, 2.0, 6.0]  # host load changes between rounds by up to 16x
    s = _paired.summary([d for d in drift], [1.25 * d for d in drift], goal=1.2)
    assert s["median"] == pytest.approx(1.25) and s["q1"] == s["q3"] == pytest.approx(1.25)
    assert s["goal_met"] is True


def test_summary_rejects_unpaired_or_empty():
    with pytest.raises(ValueError):
        _paired.summary([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        _paired.summary([], [])
    with pytest.raises(ValueError):
        _paired.summary([0.0], [1.0])
    assert _paired.quartiles([2.0]) == (2.0, 2.0, 2.0)


def test_provenance_block_and_fresh_file(tmp_path):
    run = _provenance.Run(interval_s=0.05)
    out = tmp_path / "r.json"
    out.write_text("")  # an existing empty file is replaced, never read
    written = run.write(out, {"x": 1})
    run.stop()
    p = json.loads(out.read_text())["provenance"]
    assert written["x"] == 1 and p["commit"] and p["command"] and p["date"].endswith("Z")
    assert p["load_1min"]["min"] <= p["load_1min"]["median"] <= p["load_1min"]["max"] and p["wall_s"] >= 0


def test_parts_file_merges_only_when_asked(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("")
    run = _provenance.Run(interval_s=10)
    first = _provenance.PartsFile(out, run, merge=True)  # empty file: no earlier parts, no crash
    first.add("sim", {"s": 1}, since=run.start)
    first.add("auto", {"a": 2}, since=run.start)
    again = _provenance.PartsFile(out, run, merge=True)
    again.add("sim", {"s2": 3}, since=run.start)
    d = json.loads(out.read_text())
    assert d["a"] == 2 and d["s2"] == 3 and "s" not in d
    assert set(d["provenance"]["parts"]) == {"sim", "auto"} and d["provenance"]["parts"]["sim"]["keys"] == ["s2"]
    fresh = _provenance.PartsFile(out, run, merge=False)
    fresh.add("auto", {"a": 4}, since=run.start)
    run.stop()
    assert set(json.loads(out.read_text())) == {"a", "provenance"}


def test_parts_file_labels_the_keys_of_an_old_file(tmp_path):
    out = tmp_path / "old.json"
    out.write_text(json.dumps({"k": 1, "j": 2}))
    run = _provenance.Run(interval_s=10)
    parts = _provenance.PartsFile(out, run, merge=True)
    parts.add("auto", {"j": 3}, since=run.start)
    run.stop()
    d = json.loads(out.read_text())
    assert (d["k"], d["j"]) == (1, 3)
    assert d["provenance"]["parts"]["unrecorded"]["keys"] == ["k"]
    assert d["provenance"]["parts"]["unrecorded"]["commit"].startswith("unknown")
    rerun = _provenance.PartsFile(out, run, merge=True)
    rerun.add("sim", {"k": 4}, since=run.start)  # every unrecorded key measured again: that part is gone
    assert set(json.loads(out.read_text())["provenance"]["parts"]) == {"auto", "sim"}


def test_parts_file_absorbs_the_parts_of_another_file(tmp_path):
    run = _provenance.Run(interval_s=10)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _provenance.PartsFile(a, run).add("auto", {"x": 1, "y": 1}, since=run.start)
    _provenance.PartsFile(b, run).add("heldout", {"y": 2, "z": 3}, since=run.start)
    merged = _provenance.PartsFile(a, run, merge=True)
    merged.absorb(b)
    run.stop()
    d = json.loads(a.read_text())
    assert (d["x"], d["y"], d["z"]) == (1, 2, 3)
    parts = d["provenance"]["parts"]
    assert parts["auto"]["keys"] == ["x"] and parts["heldout"]["keys"] == ["y", "z"]
