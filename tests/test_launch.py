"""Tests of ``whale launch``: torchrun argument building, worker environment, CLI parsing, and end-to-end
runs (standalone, and two launchers on loopback acting as two nodes) of tests/scripts/launch_probe.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_port
from whale import cli
from whale.runtime import launch as launch_mod
from whale.runtime.launch import LaunchError, launch, torchrun_args, torchrun_command, worker_env

PROBE = Path(__file__).parent / "scripts" / "launch_probe.py"
E2E_TIMEOUT_S = 60.0

# ---------------------------------------------------------------------------------------------- torchrun_args


def test_standalone_args():
    """No rendezvous flag: one machine, --standalone, script args after the script."""
    assert torchrun_args(4, "train.py", ["--steps", "5"]) == [
        "--standalone", "--nproc-per-node", "4", "--", "train.py", "--steps", "5",
    ]


def test_static_multinode_args():
    """Static rendezvous flags are passed through and --standalone is dropped."""
    args = torchrun_args(2, "train.py", ["x"], nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert args == [
        "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "--", "train.py", "x",
    ]


def test_dynamic_rendezvous_args():
    """c10d rendezvous flags, elastic MIN:MAX nodes and --max-restarts."""
    args = torchrun_args(8, "t.py", nnodes="1:4", rdzv_backend="c10d", rdzv_endpoint="h:29400",
                         rdzv_id="job", max_restarts=3)
    assert "--standalone" not in args
    assert args == [
        "--nproc-per-node", "8", "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
        "--rdzv-id", "job", "--max-restarts", "3", "--", "t.py",
    ]


@pytest.mark.parametrize("flag,value", [
    ("nnodes", 2), ("node_rank", 0), ("master_addr", "127.0.0.1"), ("rdzv_endpoint", "h:1"),
    ("master_port", 29500), ("rdzv_backend", "c10d"), ("rdzv_id", "j"),
])
def test_any_rendezvous_flag_disables_standalone(flag, value):
    """Each rendezvous flag alone switches off --standalone (otherwise torchrun would ignore it)."""
    args = torchrun_args(1, "t.py", **{flag: value})
    assert "--standalone" not in args
    assert args[args.index("--" + flag.replace("_", "-")) + 1] == str(value)


def test_max_restarts_keeps_standalone():
    """--max-restarts is not a rendezvous flag."""
    assert torchrun_args(2, "t.py", max_restarts=1)[:1] == ["--standalone"]


def test_script_args_untouched():
    """Arguments that look like launcher or torchrun options reach the script verbatim."""
    tail = ["-n", "3", "--nnodes", "2", "--", "--help", "a b", "", "--node"]
    assert torchrun_args(1, Path("dir/t.py"), tail)[-len(tail) - 2:] == ["--", "dir/t.py", *tail]


@pytest.mark.parametrize("nproc", [0, -1, True, 1.5, "2"])
def test_bad_nproc(nproc):
    """The process count must be an int >= 1."""
    with pytest.raises(LaunchError, match="nproc-per-node"):
        torchrun_args(nproc, "t.py")


@pytest.mark.parametrize("kwargs,match", [
    ({"nnodes": 0}, "--nnodes"),
    ({"nnodes": "a"}, "--nnodes"),
    ({"nnodes": "3:2"}, "minimum"),
    ({"nnodes": "1:2:3"}, "--nnodes"),
    ({"node_rank": -1}, "--node-rank"),
    ({"nnodes": 2, "node_rank": 2}, "out of range"),
    ({"master_port": 0}, "--master-port"),
    ({"master_port": 70000}, "--master-port"),
    ({"max_restarts": -1}, "--max-restarts"),
])
def test_bad_rendezvous(kwargs, match):
    """Malformed rendezvous options fail before anything starts, naming the flag."""
    with pytest.raises(LaunchError, match=match):
        torchrun_args(1, "t.py", **kwargs)


def test_torchrun_command_uses_this_interpreter():
    """torchrun runs as ``python -m torch.distributed.run`` with the current interpreter."""
    assert torchrun_command(["a"]) == [sys.executable, "-m", "torch.distributed.run", "a"]


# ------------------------------------------------------------------------------------------------ worker_env


def test_env_defaults_threads_to_one():
    """OMP_NUM_THREADS=1 unless set; no WHALE_CLUSTER without --cluster."""
    env = worker_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}


def test_env_keeps_user_threads_and_threads_overrides():
    """A user's OMP_NUM_THREADS is kept; --threads wins over it."""
    assert worker_env({"OMP_NUM_THREADS": "6"})["OMP_NUM_THREADS"] == "6"
    assert worker_env({"OMP_NUM_THREADS": "6"}, threads=2)["OMP_NUM_THREADS"] == "2"
    with pytest.raises(LaunchError, match="--threads"):
        worker_env({}, threads=0)


def test_env_cluster(tmp_path, monkeypatch):
    """--cluster is exported as an absolute path, after checking that the file exists."""
    (tmp_path / "spec.yaml").write_text("nodes: []\n")
    monkeypatch.chdir(tmp_path)
    assert worker_env({}, cluster="spec.yaml")["WHALE_CLUSTER"] == str(tmp_path / "spec.yaml")
    with pytest.raises(LaunchError, match="cluster spec 'missing.yaml' does not exist"):
        worker_env({}, cluster="missing.yaml")
    with pytest.raises(LaunchError, match="not a file"):
        worker_env({}, cluster=tmp_path)


# ---------------------------------------------------------------------------------------------------- launch


@pytest.fixture
def no_run(monkeypatch):
    """Replace the torchrun step of launch(); record what it would have run."""
    calls = []
    monkeypatch.setattr(launch_mod, "_run", lambda args, env: calls.append((args, env)) or 0)
    return calls


def test_launch_builds_args_and_env(tmp_path, no_run):
    """launch() runs torchrun with the built arguments and the worker environment."""
    spec = tmp_path / "c.yaml"
    spec.write_text("nodes:\n" + "  - devices: [V100-32GB, V100-32GB, V100-32GB]\n" * 2)  # 3 per node x 2 nodes
    assert launch(3, PROBE, ["--x"], cluster=spec, nnodes=2, node_rank=0) == 0
    (args, env), = no_run
    assert args == torchrun_args(3, PROBE, ["--x"], nnodes=2, node_rank=0)
    assert env["WHALE_CLUSTER"] == str(spec) and env["OMP_NUM_THREADS"]


def test_launch_errors_before_running(tmp_path, no_run):
    """A missing script, missing cluster spec or bad count is reported and nothing runs."""
    with pytest.raises(LaunchError, match="training script .* does not exist"):
        launch(1, tmp_path / "nope.py")
    with pytest.raises(LaunchError, match="cluster spec"):
        launch(1, PROBE, cluster=tmp_path / "nope.yaml")
    with pytest.raises(LaunchError, match="nproc"):
        launch(0, PROBE)
    with pytest.raises(TypeError, match="nprocs"):
        launch(1, PROBE, nprocs=2)
    assert no_run == []


def _fake_torchrun(monkeypatch, exc=None):
    """Make torchrun's main record its arguments and the environment it saw, then raise ``exc``."""
    import torch.distributed.run

    seen = []

    def fake_main(args):
        """Stand-in for ``torch.distributed.run.main``."""
        seen.append((args, dict(os.environ)))
        if exc is not None:
            raise exc

    monkeypatch.setattr(torch.distributed.run, "main", fake_main)
    return seen


def test_run_uses_env_and_restores_it(monkeypatch):
    """torchrun sees exactly the worker env; the launcher's own environment is restored afterwards."""
    seen = _fake_torchrun(monkeypatch)
    before = dict(os.environ)
    assert launch_mod._run(["a", "b"], {"ONLY": "this"}) == 0
    assert seen == [(["a", "b"], {"ONLY": "this"})]
    assert dict(os.environ) == before


@pytest.mark.parametrize("worker_code,expected", [(3, 3), (-signal.SIGKILL, 128 + signal.SIGKILL)])
def test_run_returns_failed_worker_exit_code(monkeypatch, capsys, worker_code, expected):
    """A failed worker's exit code comes back (signals as 128 + N), after torchrun's failure summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=worker_code, error_file="/nonexistent")
    _fake_torchrun(monkeypatch, ChildFailedError("probe.py", {0: failure}))
    assert launch_mod._run([], dict(os.environ)) == expected
    assert "probe.py FAILED" in capsys.readouterr().err


def test_run_signal(monkeypatch):
    """A launcher stopped by a signal (torchrun stops the workers) exits with 128 + N."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _fake_torchrun(monkeypatch, SignalException("stop", signal.SIGTERM))
    assert launch_mod._run([], dict(os.environ)) == 128 + signal.SIGTERM


# ------------------------------------------------------------------------------------------------------- CLI


def test_cli_dry_run_parses_passthrough(capsys):
    """Options after the script belong to the script, even ones the launcher also has."""
    assert cli.main(["launch", "-n", "2", "--dry-run", str(PROBE), "-n", "3", "--dry-run", "--", "z"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith(f"--standalone --nproc-per-node 2 -- {PROBE} -n 3 --dry-run -- z")


def test_cli_multinode_dry_run(capsys):
    """Rendezvous flags on the command line reach torchrun; abbreviations after the script stay the script's."""
    argv = ["launch", "--dry-run", "-n", "1", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", "29511", str(PROBE), "--node", "--rdzv"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "--standalone" not in out
    assert "--nproc-per-node 1 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 29511" in out
    assert out.strip().endswith(f"-- {PROBE} --node --rdzv")


@pytest.mark.parametrize("argv,match", [
    (["-n", "0", str(PROBE)], "must be an integer >= 1, got 0"),
    (["missing_script.py"], "training script 'missing_script.py' does not exist"),
    (["--cluster", "missing.yaml", str(PROBE)], "cluster spec 'missing.yaml' does not exist"),
    (["-n", "two", str(PROBE)], "invalid int value"),
    (["--node", "1", str(PROBE)], "unrecognized arguments: --node"),
    ([], "required: script"),
])
def test_cli_errors(argv, match, capsys):
    """Bad input gives a one-line argparse error (exit code 2), not a traceback."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_help(capsys):
    """``whale --help`` lists launch; ``whale launch --help`` shows the rendezvous flags and examples."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0 and "launch" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    text = capsys.readouterr().out
    for word in ("--nnodes", "--node-rank", "--master-addr", "--rdzv-endpoint", "--cluster", "--threads",
                 "examples:"):
        assert word in text
    assert cli.main([]) == 2


# ------------------------------------------------------------------------------------------------ end to end


def _whale() -> list[str]:
    """The ``whale`` console script next to this interpreter, else ``python -m whale.cli``."""
    script = Path(sys.executable).with_name("whale")
    return [str(script)] if script.exists() else [sys.executable, "-m", "whale.cli"]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (torchrun stops its workers), then SIGKILL its process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _run_launchers(argvs: list[list[str]], tmp_path: Path) -> list[tuple[int, str]]:
    """Start ``whale launch`` once per argv at the same time; return (exit code, output) of each.

    Output goes to files (no pipe can fill up while another launcher is waited on); every process is
    stopped after ``E2E_TIMEOUT_S`` seconds so that a failing rendezvous cannot hang the suite.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    try:
        for i, argv in enumerate(argvs):
            log = tmp_path / f"launcher{i}.log"
            with open(log, "w") as fh:
                procs.append(subprocess.Popen([*_whale(), "launch", *argv], env=env, stdout=fh,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            logs.append(log)
        deadline = time.monotonic() + E2E_TIMEOUT_S
        for proc, log in zip(procs, logs, strict=True):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"whale launch timed out after {E2E_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")
    finally:
        for proc in procs:
            _stop(proc)
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs, strict=True)]


def _records(out_dir: Path, world: int) -> list[dict]:
    """The probe's per-rank JSON records, rank order."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_e2e_standalone_two_workers(tmp_path):
    """``whale launch -n 2`` on one machine: both workers all-reduce 1 + 2 = 3; args and env arrive."""
    tail = ["-n", "5", "--flag", "--", "x y"]
    (rc, log), = _run_launchers([["-n", "2", "--threads", "2", str(PROBE), str(tmp_path), *tail]], tmp_path)
    assert rc == 0, log
    for r, rec in enumerate(_records(tmp_path, 2)):
        assert (rec["rank"], rec["world"], rec["sum"]) == (r, 2, 3.0)
        assert rec["args"] == tail
        assert rec["omp_num_threads"] == "2" and rec["whale_cluster"] is None
    assert "sum=3" in log


@pytest.mark.slow
def test_e2e_two_nodes_on_loopback(tmp_path):
    """Two launchers as two nodes (static rendezvous on 127.0.0.1): world 2, both see the sum 3."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: [{devices: [V100-32GB]}, {devices: [V100-32GB]}]\n")
    port = str(free_port())
    argvs = [
        ["-n", "1", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
         "--master-port", port, "--cluster", str(spec), str(PROBE), str(tmp_path), "--node", str(rank)]
        for rank in (0, 1)
    ]
    results = _run_launchers(argvs, tmp_path)
    for rc, log in results:
        assert rc == 0, log
    recs = _records(tmp_path, 2)
    for r, rec in enumerate(recs):
        assert (rec["rank"], rec["world"], rec["sum"]) == (r, 2, 3.0)
        assert rec["args"] == ["--node", str(r)]  # global rank r runs on node r (one worker per node)
        assert rec["whale_cluster"] == str(spec.resolve()) and rec["omp_num_threads"] == "1"
    assert all("sum=3" in log for _, log in results)
