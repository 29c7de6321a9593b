"""Every fenced code block of README.md and docs/*.md is run, or marked not-run with a reason, so no example rots.

A block's info string (the words after the opening fence) says what it is:

- ``python``: run. All of them run in one interpreter (``tests/scripts/run_doc_blocks.py``, ``PYTHONPATH=src``,
  ``HF_HUB_OFFLINE=1``, a fresh ``WHALE_CALIBRATION`` and a scratch working directory), each in a fresh
  namespace; ``python continues`` runs in the previous block's namespace. A block starting with ``>>>`` is a
  doctest: its printed output is checked too. ``python launch=2``: the block needs two ranks; all such blocks
  run in order in one job under the real launcher, ``whale launch -n 2``.
- ``bash`` / ``sh``: every command (continuation lines joined, ``#`` comments dropped) must be a ``whale ...``
  command, run through ``whale.cli.main`` in the shared interpreter (``whale simulate`` on a seeded calibration,
  so it measures nothing); ``bash fails`` expects each to exit non-zero. Commands that take minutes or need
  other machines are marked ``bash no-run (reason)``; their commands are still checked without running them:
  make targets exist, ``make train`` / ``make train-hf``'s ``TRAIN_ARGS`` parse with the job's own argument
  parser and its ``CLUSTER`` file exists, scripts named exist. An unmarked block that cannot be run fails.
- ``yaml file=PATH``: the block must be the file's text (comment lines aside).
- ``text``: output, not run; ``text output`` must appear line by line, in order, in the printed output of the
  block before it.

At most :data:`MAX_NO_RUN` blocks may be marked not-run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNER = ROOT / "tests" / "scripts" / "run_doc_blocks.py"
MAX_NO_RUN = 10
LANGS = {"python", "bash", "sh", "yaml", "text"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>.*)$")


def blocks() -> list[dict]:
    """Every fenced block of the docs: file (relative), line of its first text line (1-based minus one, i.e. the
    fence's line number), language, attributes (the rest of the info string) and its text, dedented."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, info = m["indent"], m["info"].strip()
            start, i = i + 1, i + 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            assert i < len(lines), f"{path.name}:{start}: a code block that is never closed"
            text = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[start:i])
            lang, _, attrs = info.partition(" ")
            out.append({"file": str(path.relative_to(ROOT)), "line": start, "lang": lang, "attrs": attrs.strip(),
                        "text": text + "\n", "id": f"{path.relative_to(ROOT)}:{start}"})
            i += 1
    return out


def commands(text: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comment lines and trailing comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            out.append(shlex.join(shlex.split(full, comments=True)))
    return out


def _whale_argv(cmd: str) -> list[str] | None:
    argv = shlex.split(cmd)
    return ["whale", *argv[1:]] if argv and argv[0] in ("whale", ".venv/bin/whale") else None


def plan_runs() -> tuple[list[dict], list[dict], list[dict]]:
    """(blocks run in one process, blocks run under ``whale launch -n 2``, not-run blocks); raises on a block
    that is neither runnable nor marked."""
    one, launched, skipped = [], [], []
    for b in blocks():
        where, attrs = b["id"], b["attrs"]
        assert b["lang"] in LANGS, f"{where}: a code block's language must be one of {sorted(LANGS)}, got " \
                                   f"{b['lang']!r} (output: text)"
        if b["lang"] == "python":
            entry = {**b, "kind": "doctest" if b["text"].lstrip().startswith(">>>") else "python",
                     "continues": "continues" in attrs.split()}
            if "launch=" in attrs:
                assert "launch=2" in attrs.split(), f"{where}: only launch=2 is run"
                launched.append(entry)
            else:
                one.append(entry)
        elif b["lang"] in ("bash", "sh"):
            if attrs.startswith("no-run"):
                assert re.fullmatch(r"no-run \(.+\)", attrs), f"{where}: write the reason: no-run (why)"
                skipped.append(b)
                continue
            for cmd in commands(b["text"]):
                argv = _whale_argv(cmd)
                assert argv, f"{where}: `{cmd}` is not a whale command this test can run: mark the block " \
                             f"`bash no-run (reason)` or make it one"
                one.append({**b, "kind": "command", "text": shlex.join(argv), "fails": "fails" in attrs.split()})
    return one, launched, skipped


def test_every_block_is_run_or_marked_with_a_reason():
    one, launched, skipped = plan_runs()
    assert len(skipped) <= MAX_NO_RUN, f"{len(skipped)} blocks marked no-run: {[b['id'] for b in skipped]}"
    assert one and launched


def test_yaml_blocks_are_the_files_they_name():
    for b in blocks():
        if b["lang"] != "yaml":
            continue
        m = re.fullmatch(r"file=(\S+)", b["attrs"])
        assert m, f"{b['id']}: a yaml block names its file: yaml file=PATH"

        def body(text):
            lines = (ln.split(" #")[0].rstrip() for ln in text.splitlines())  # comments aside
            return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]

        assert body(b["text"]) == body((ROOT / m[1]).read_text()), f"{b['id']}: differs from {m[1]}"


def _check_make(cmd: str, where: str) -> None:
    argv = shlex.split(cmd)
    targets = [a for a in argv[1:] if "=" not in a]
    variables = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    makefile = (ROOT / "Makefile").read_text()
    for t in targets:
        assert re.search(rf"^{re.escape(t)}:", makefile, re.M), f"{where}: no make target {t!r}"
    if variables.get("CLUSTER"):
        assert (ROOT / variables["CLUSTER"]).is_file(), f"{where}: no cluster spec {variables['CLUSTER']}"
    if targets in (["train"], ["train-hf"]):
        if targets == ["train"]:
            from examples.gpt.train import parse_args
        else:
            from examples.hf.train import parse_args
        try:
            parse_args(shlex.split(variables.get("TRAIN_ARGS", "")))
        except SystemExit as exc:
            raise AssertionError(f"{where}: TRAIN_ARGS of `{cmd}` do not parse") from exc


def test_not_run_commands_name_real_targets_flags_and_files():
    """The commands of the no-run blocks are checked without running them."""
    for b in plan_runs()[2]:
        for cmd in commands(b["text"]):
            argv = [a for a in shlex.split(cmd) if not re.fullmatch(r"[A-Z_]+=\S*", a)]  # env assignments
            if argv[0] == "make":
                _check_make(cmd, b["id"])
            elif argv[0] in ("python", ".venv/bin/python", "whale", ".venv/bin/whale"):
                scripts = [a for a in argv if a.endswith(".py")]
                assert all((ROOT / s).is_file() for s in scripts), f"{b['id']}: `{cmd}` names a missing script"
                if argv[0].endswith("whale"):
                    assert argv[1] in ("launch", "plan", "simulate", "checkpoint"), f"{b['id']}: `{cmd}`"
            else:
                raise AssertionError(f"{b['id']}: `{cmd}`: a no-run command must be make, python or whale")


def _env(tmp: Path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1",
            "WHALE_CALIBRATION": str(tmp / "calibration.json"), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts a docs job on first request (``one``: one process; ``launched``: two ranks under ``whale launch``), in a
    scratch directory that sees the repository's examples/ and benchmarks/. Each test asks only for its own job:
    the two tests usually run in different pytest-xdist workers, each with its own module fixture, and a fixture
    that started both jobs ran every block twice."""
    tmp = tmp_path_factory.mktemp("docs")
    for name in ("examples", "benchmarks", "data"):
        if (ROOT / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    one, launched, _ = plan_runs()
    todos = {"one": (one, [sys.executable]),
             "launched": (launched, [str(Path(sys.executable).parent / "whale"), "launch", "-n", "2"])}
    jobs = {}

    def start(name: str):
        if name not in jobs:
            todo, argv = todos[name]
            (tmp / f"{name}.json").write_text(json.dumps(todo))
            jobs[name] = (todo, subprocess.Popen([*argv, str(RUNNER), str(tmp / f"{name}.json"),
                                                  str(tmp / f"{name}_results.json")], cwd=tmp, env=_env(tmp),
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return tmp, jobs[name]

    yield start
    for _, proc in jobs.values():
        if proc.poll() is None:
            proc.kill()


def _results(runs, name: str, timeout: float) -> list[dict]:
    tmp, (todo, proc) = runs(name)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the {name} docs blocks ran past {timeout} s: {proc.communicate()[0][-3000:]}") from None
    assert proc.returncode == 0, f"the {name} docs blocks failed (exit {proc.returncode}):\n{output[-6000:]}"
    results = json.loads((tmp / f"{name}_results.json").read_text())
    failed = [f"{r['id']}:\n{r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert [r["id"] for r in results] == [b["id"] for b in todo]
    return results


def _check_outputs(results: list[dict]) -> None:
    """Each ``text output`` block's lines appear in order in the printed output of the block before it."""
    printed = {r["id"]: r["stdout"] for r in results}
    runnable = [b for b in blocks() if b["lang"] in ("python", "bash", "sh")]
    for b in blocks():
        if b["lang"] != "text" or b["attrs"] != "output":
            continue
        before = [r for r in runnable if r["file"] == b["file"] and r["line"] < b["line"]][-1]
        if before["id"] not in printed:
            continue
        out, pos = printed[before["id"]].splitlines(), 0
        for want in b["text"].splitlines():
            hits = [i for i in range(pos, len(out)) if out[i].rstrip() == want.rstrip()]
            assert hits, f"{b['id']}: {want!r} is not in what {before['id']} printed:\n{printed[before['id']]}"
            pos = hits[0] + 1


@pytest.mark.timeout(540)
def test_one_process_blocks_run(runs):
    results = _results(runs, "one", timeout=500)
    _check_outputs(results)


@pytest.mark.timeout(540)
def test_two_rank_blocks_run_under_whale_launch(runs):
    results = _results(runs, "launched", timeout=500)
    _check_outputs(results)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists and, with ``#anchor``, one of its
    headings."""
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.name}: link to a missing {target}"
            if anchor:
                assert anchor in _anchors(dest), f"{doc.name}: no heading #{anchor} in {dest.name}"
