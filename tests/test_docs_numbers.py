"""The benchmark numbers in the docs cannot go stale: docs/benchmarks.md's results block is what
benchmarks/report.py renders from benchmarks/results/*.json now, and every cited number in README.md and
docs/*.md (``NUMBER<!-- results:FILE:KEY -->``) equals its JSON value at the precision shown. Process-free."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import _staleness, report

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_rendered_block_is_current():
    text = report.DOC.read_text()
    assert report.splice(text, report.render()) == text, "docs/benchmarks.md is stale: run `make report`"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_numbers_match_their_json(path):
    bad = report.check_citations(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_citation_check_catches_a_typed_number():
    row = next(r for r in report.ROWS if r[2] == "zero3_vs_fsdp2_peak_memory")
    value = report.lookup(report._load(row[1], {}), row[2])
    good = report.cite(row[1], row[2], value, 3)
    assert report.check_citations(f"peak memory ratio {good}") == []
    wrong = f"{float(good.split('<')[0]) + 0.01:.3f}<!-- results:{row[1]}:{row[2]} -->"
    assert report.check_citations(wrong), "a number that differs from its JSON must be reported"
    assert report.check_citations("1.0<!-- results:zero3.json:no_such_key -->")


def test_staleness_compares_measured_code_with_head():
    """HEAD's own commit measured HEAD's code; an unknown commit is reported as unknown, not as current."""
    assert _staleness.changed_since("HEAD") == []
    assert _staleness.changed_since("HEAD+dirty") == []
    assert _staleness.changed_since("0" * 40) is None


def test_a_results_measured_code_follows_its_scripts_imports():
    """A benchmark's own script and the benchmark modules it imports count; another benchmark's script does not."""
    mods = _staleness.benchmark_modules("benchmarks/pipeline_overheads.py")
    assert {"benchmarks/pipeline_overheads.py", "benchmarks/vs_torch_pipelining.py", "benchmarks/pipeline_bubble.py",
            "benchmarks/_launch.py"} <= set(mods)
    assert "benchmarks/heterogeneous.py" not in mods and "benchmarks/_hetero_model.py" not in mods


def test_refresh_rewrites_a_stale_cited_number_at_its_precision():
    value = report.lookup(report._load("paper_10t.json", {}), "paper_10t.device_bytes")
    text = "fits in 1,234<!-- results:paper_10t.json:paper_10t.device_bytes --> bytes; 0.5<!-- results:" \
           "paper_10t.json:paper_10t.predicted_step_seconds --> s"
    new, changed = report.refresh_citations(text)
    assert new.startswith(f"fits in {float(value):,.0f}<!-- results:") and changed >= 1
    assert not report.check_citations(new)


def test_a_dirty_run_is_stale_only_for_uncommitted_measured_code():
    script = "benchmarks/paper_10t.py"
    assert _staleness._dirty_measured({"dirty_files": ["benchmarks/run_all.sh", "docs/x.md"]}, script) == []
    assert _staleness._dirty_measured({"dirty_files": ["src/whale/__init__.py"]}, script) == ["src/whale/__init__.py"]
    assert _staleness._dirty_measured({"dirty_files": [script]}, script) == [script]
    assert _staleness._dirty_measured({}, script) is None  # not recorded: unknown, reported as such
