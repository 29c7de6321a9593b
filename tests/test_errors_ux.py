"""What a user sees when something goes wrong (issue 23): one ``error: [rank R] Type: message`` line per failing
rank and one traceback, Ctrl-C in one line, the launcher naming the rank that failed first, a cluster spec of
another size refused before any worker starts, checkpoint paths that are files named as such, and the GPT job's
resume message for every case."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.test_launch import PROBE, _run_launchers
from whale import cli
from whale.runtime import attribution, ckpt_store, failures
from whale.runtime import launch as launch_mod
from whale.runtime.ckpt_store import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def _raise(exc: BaseException) -> BaseException:
    """``exc`` with a traceback (raised and caught here)."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - handed back
        return caught


@pytest.fixture
def ranks(monkeypatch, tmp_path):
    """Report errors as rank ``r`` of 4 of a ``whale launch`` job (error directory ``tmp_path``): returns
    ``report(exc, r, **kw) -> printed text``. No processes."""
    monkeypatch.setenv(failures.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)

    def report(exc, r, **kw):
        monkeypatch.setattr(failures, "_rank_world", lambda: (r, 4))
        out = io.StringIO()
        failures.report_error(exc, file=out, **kw)
        return out.getvalue()

    return report


# ------------------------------------------------------------------------------- error report (no processes)


def test_one_traceback_then_one_line_per_rank(ranks, tmp_path):
    """No processes. The first failing rank prints the traceback ending in its error line; a rank with the same
    traceback prints its line alone, one with another traceback names the file holding it."""
    same = _raise(ValueError("width 4 does not divide 6; pass --width 1, 2, 3 or 6"))
    first = ranks(same, 2)
    assert first.startswith("Traceback (most recent call last):") and first.count("Traceback") == 1
    assert first.endswith("error: [rank 2] ValueError: width 4 does not divide 6; pass --width 1, 2, 3 or 6\n")
    assert ranks(same, 0) == ("error: [rank 0] ValueError: width 4 does not divide 6; pass --width 1, 2, 3 or 6 "
                              "(the same traceback as rank 2's)\n")
    other = ranks(_raise(KeyError("lm_head.weight")), 3)
    path = re.fullmatch(r"error: \[rank 3\] KeyError: 'lm_head.weight' \(traceback in (.+)\)\n", other).group(1)
    assert Path(path).parent == tmp_path and "KeyError: 'lm_head.weight'" in Path(path).read_text()
    assert failures.first_failure(tmp_path) == (
        2, "error: [rank 2] ValueError: width 4 does not divide 6; pass --width 1, 2, 3 or 6")


def test_config_errors_print_the_line_alone_and_peers_name_the_first_rank(ranks):
    """No processes. ``traceback=False`` (the GPT job's configuration errors): the line on every rank, the first
    still recorded; a rank stopped by a peer's failure names the rank that failed first and says that its error
    is one line (it printed no traceback to point to)."""
    exc = _raise(ValueError("--stages 3 does not divide the world size 4\nmore detail"))
    for r in (1, 0):
        want = f"error: [rank {r}] ValueError: --stages 3 does not divide the world size 4 [...]\n"
        assert ranks(exc, r, traceback=False) == want
    peer = ranks(_raise(dist.DistBackendError("[../gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:5123. "
                                              "More")), 3)
    assert re.fullmatch(r"error: \[rank 3\] stopped (at step \d+, .* )?because rank 1 failed first with ValueError "
                        r"\(Connection closed by peer \[127.0.0.1\]:5123\); its error is printed by that rank, in one "
                        r"line\n", peer), peer


def test_ctrl_c_is_one_line_for_the_job(ranks):
    """No processes. KeyboardInterrupt: the first interrupted rank prints one line, the others nothing."""
    assert [ranks(_raise(KeyboardInterrupt()), r) for r in (1, 0, 2)] == [
        "interrupted (KeyboardInterrupt, first on rank 1): stopping\n", "", ""]


def _failed(exitcodes: dict) -> Exception:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError("train.py", {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c,
                                                           error_file="/nonexistent") for r, c in exitcodes.items()})


def test_the_launcher_names_the_recorded_first_rank(tmp_path):
    """No processes. The recorded first rank wins over torchrun's earliest exit; when torchrun terminated it while
    it was exiting, the job's exit code is the failing ranks' (1), not SIGTERM's."""
    e = _failed({0: 1, 1: -15})
    assert attribution.summary(e, None)[0].startswith("train.py FAILED: rank 0 failed first (exit code 1);")
    (tmp_path / "failure-0").write_text(json.dumps({"rank": 1, "line": "error: [rank 1] ValueError: bad width"}))
    assert attribution.summary(e, tmp_path) == (
        "train.py FAILED: rank 1 failed first (exit code 1) with ValueError; its error is printed above; "
        "1 other rank(s) failed or were stopped after it", 1)


def test_error_report_through_the_store_under_plain_torchrun():
    """2 gloo ranks, no ``whale launch`` (no error directory): the job's store records the first failure, so
    the same error on both ranks gives one traceback and two error lines."""
    outs = run_ranks(_report_on_every_rank, 2, timeout=60)
    assert sum(o.count("Traceback (most recent call last)") for o in outs) == 1
    lines = sorted(line for o in outs for line in o.splitlines() if line.startswith("error: "))
    assert [re.sub(r" \(the same.*", "", x) for x in lines] == [
        f"error: [rank {r}] ValueError: --stages 3 does not divide 4" for r in (0, 1)]


def _report_on_every_rank(rank, world):
    import os

    import torch.distributed as dist

    os.environ.pop(failures.ERROR_DIR_ENV, None)
    out = io.StringIO()
    failures.report_error(_raise(ValueError("--stages 3 does not divide 4")), file=out)
    dist.barrier()
    return out.getvalue()


@pytest.mark.slow
def test_whale_launch_prints_one_traceback_for_an_error_on_every_rank(tmp_path):
    """``whale launch -n 2`` of a script that raises the same error on both ranks after ``wh.init``: one
    traceback, one error line per rank, the launcher names the first rank; exit code 1."""
    script = tmp_path / "raise_everywhere.py"
    script.write_text("import whale as wh\nctx = wh.init()\nraise ValueError('--width 4 does not divide 6')\n")
    (rc, log), = _run_launchers([["-n", "2", str(script)]], tmp_path)
    assert rc == 1, log
    assert log.count("Traceback (most recent call last)") == 1, log
    ranks = sorted(re.findall(r"^error: \[rank (\d)\] ValueError: --width 4 does not divide 6", log, re.M))
    assert ranks == ["0", "1"], log
    first = re.search(r"raise_everywhere.py FAILED: rank (\d) failed first \(exit code 1\) with ValueError", log)
    assert first and re.search(rf"^error: \[rank {first.group(1)}\] ValueError: [^(]*$", log, re.M), log


@pytest.mark.slow
def test_a_bad_flag_is_one_line_per_rank_and_the_launcher_names_it(tmp_path):
    """``whale launch -n 2 examples/gpt/train.py --schedule interleave``: no usage block, one ``error:`` line per
    rank that got to print it (torchrun stops the other when the first exits) pointing to --help, and the launcher
    names the rank and its ConfigError instead of saying it ended without reporting an error; exit code 2."""
    (rc, log), = _run_launchers([["-n", "2", str(ROOT / "examples/gpt/train.py"), "--schedule", "interleave"]],
                                tmp_path)
    assert rc == 2 and "usage:" not in log, log
    said = re.findall(r"^error: \[rank (\d)\] ConfigError: argument --schedule: unknown schedule 'interleave'; "
                      r"choose gpipe, 1f1b, interleaved or zb \(see train.py --help\)$", log, re.M)
    first = re.search(r"train.py FAILED: rank (\d) failed first \(exit code 2\) with ConfigError; its error is "
                      r"printed above", log)
    assert first and first.group(1) in said and len(said) == len(set(said)), log


# ----------------------------------------------------------------------------------- launcher: cluster size


@pytest.mark.parametrize("argv,match", [
    (["-n", "3"], "declares 4 devices but -n 3 starts 3 processes; pass a spec of 3 devices or -n 4"),
    (["-n", "1", "--nnodes", "2", "--node-rank", "0"],
     "declares 4 devices but -n 1 x --nnodes 2 starts 2 processes; pass a spec of 2 devices or -n 2"),
])
def test_a_cluster_spec_of_another_size_fails_in_the_launcher(argv, match, tmp_path, capsys, monkeypatch):
    """No processes: ``whale launch -n 3 --cluster <4 devices>`` stops before any worker starts, one line
    naming both numbers and the fix."""
    ran = []
    monkeypatch.setattr(launch_mod, "_run", lambda args, env: ran.append(args) or 0)
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", *argv, "--cluster", str(ROOT / "examples/clusters/v100_p100.yaml"), str(PROBE)])
    assert exc.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert re.search(r"error: --cluster '.*v100_p100.yaml' " + re.escape(match), err), err
    assert cli.main(["launch", "-n", "4", "--cluster", str(ROOT / "examples/clusters/v100_p100.yaml"),
                     str(PROBE)]) == 0 and len(ran) == 1


# --------------------------------------------------------------------------------- checkpoint path is a file


def test_a_checkpoint_path_that_is_a_file_is_named_on_load(tmp_path):
    """No processes: loading (or looking for the latest checkpoint) from a file says it is a file and that a
    checkpoint is a directory; a file inside a checkpoint names its directory."""
    f = tmp_path / "ckpt.pt"
    f.write_text("x")
    for call in (ckpt_store.resolve, ckpt_store.latest_checkpoint):
        with pytest.raises(CheckpointError, match=rf"checkpoint path '{re.escape(str(f))}' is a file: a checkpoint is "
                                                  r"a directory .*pass a directory path"):
            call(f)
    with pytest.raises(CheckpointError, match=rf"is under '{re.escape(str(f))}', which is a file"):
        ckpt_store.resolve(f / "step-00000001")
    marker = tmp_path / "step-00000004" / ckpt_store.MARKER
    marker.parent.mkdir()
    marker.write_text("{}")
    with pytest.raises(CheckpointError, match=rf"pass its directory '{re.escape(str(marker.parent))}'"):
        ckpt_store.resolve(marker)


def _save_to(rank, world, path):
    import whale as wh
    from tests.reshard_models import batches, engine

    e = engine("one", wh.init(wh.Config(num_micro_batch=2, seed=0)))
    e.step(batches(1)[0])
    try:
        e.save_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_saving_to_a_file_path_fails_on_every_rank(tmp_path):
    """2 gloo ranks: a save to a path that is a file raises the same CheckpointError on every rank (no rank left
    waiting in the save's collectives)."""
    f = tmp_path / "ckpt"
    f.write_text("not a directory")
    messages = run_ranks(_save_to, 2, str(f), timeout=60)
    assert messages[0] == messages[1] and messages[0].startswith(f"checkpoint path '{f}' is a file: a checkpoint is")


# ------------------------------------------------------------------------------------ GPT job: resume message


def test_resume_note_for_every_case():
    """No processes: what a resumed GPT run says about its learning-rate schedule (0.0003 = lr/10)."""
    sys.path.insert(0, str(ROOT))
    from examples.gpt.schedule import resume_note

    keep = "the learning-rate schedule keeps the checkpoint's horizon: cosine to 3.0e-04 by step "
    assert resume_note(0, 600, 600, 3e-4) is None  # a fresh run
    assert resume_note(300, 600, 600, 3e-4) is None  # resumed under the same --steps
    assert resume_note(600, 900, 600, 3e-4) == keep + "600; all of this run's steps (601-900) run at that final rate"
    assert resume_note(300, 900, 600, 3e-4) == keep + "600; steps 601-900 run at that final rate"
    assert resume_note(700, 900, 600, 3e-4) == keep + "600; all of this run's steps (701-900) run at that final rate"
    assert resume_note(10, 12, 60, 3e-4) == keep + "60; this run stops at step 12, before the cosine reaches it"
    for start in (12, 20):
        assert resume_note(start, 12, 60, 3e-4, "the checkpoint in ck") == (
            f"nothing to do: the checkpoint in ck is already at step {start} and --steps is 12; pass --steps "
            f"larger than {start} to train further")


# ----------------------------------------------------------------------------------------- teardown at exit

_EXIT_PROBE = """
import atexit, threading, time
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs after Whale's (LIFO)
import whale as wh
from whale.runtime import context
wh.init()
t0 = time.monotonic(); context._wait_until_quiet(5.0); idle = time.monotonic() - t0
stop = threading.Event()
busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
busy.start()
t0 = time.monotonic(); context._wait_until_quiet(0.3); spinning = time.monotonic() - t0
stop.set(); busy.join()
print(f"idle {idle:.3f} spinning {spinning:.3f}")
"""


def test_the_context_waits_for_running_threads_and_destroys_the_group_at_exit():
    """One process: ``wh.init``'s exit teardown returns as soon as no other thread runs, waits (bounded) while one
    does, and destroys the process group before the interpreter finalizes (benchmarks/exit_teardown.py runs the
    3+1-width pipeline 20 times for the crash this prevents)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    idle, spinning = map(float, re.search(r"idle (\S+) spinning (\S+)", proc.stdout).groups())
    assert idle < 2.0 and spinning >= 0.3, proc.stdout
    assert proc.stdout.strip().endswith("initialized at exit: False"), proc.stdout
