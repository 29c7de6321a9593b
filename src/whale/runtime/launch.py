"""Launcher: run a training script on N worker processes per node through ``torchrun``.

``whale launch`` is a thin, predictable wrapper around torchrun (``torch.distributed.run``, run in-process):

* one machine: ``--standalone --nproc-per-node N`` (torchrun picks a free port itself);
* several machines: torchrun's rendezvous flags are passed through unchanged (static rendezvous with
  ``--nnodes/--node-rank/--master-addr/--master-port``, or dynamic with ``--rdzv-backend/--rdzv-endpoint/
  --rdzv-id``); as soon as any of them is given, ``--standalone`` is dropped so that they take effect.

Workers additionally receive ``WHALE_CLUSTER`` (the absolute path of the cluster spec, read later by the
library) and ``OMP_NUM_THREADS`` (1 unless the user set it, or the value of ``--threads``). Everything after
the script path reaches the script untouched. The pure parts (:func:`torchrun_args`, :func:`worker_env`) are
separate from :func:`launch`, which only runs torchrun and returns an exit code.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from whale.cluster import ClusterError, ClusterSpec
from whale.runtime import attribution, elastic, failures, lifetime

__all__ = ["LaunchError", "check_cluster_size", "check_node_size", "torchrun_args", "torchrun_command", "worker_env",
           "launch"]

# Flags that configure the rendezvous; any of them switches the launch from --standalone to multi-node.
_RDZV_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
               "rdzv_conf")


class LaunchError(ValueError):
    """A launch request that cannot work (bad process count, missing script or cluster spec, ...)."""


def _check_nnodes(nnodes: int | str) -> None:
    """Accept ``N`` or torchrun's elastic ``MIN:MAX`` form, with positive integers."""
    parts = str(nnodes).split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(parts) not in (1, 2) or len(values) != len(parts) or min(values) < 1:
        raise LaunchError(f"--nnodes must be a positive integer or MIN:MAX, got {nnodes!r}")
    if len(values) == 2 and values[0] > values[1]:
        raise LaunchError(f"--nnodes {nnodes!r}: minimum is larger than maximum")


def _check_rdzv(nnodes, node_rank, master_port, max_restarts) -> None:
    """Validate the numeric rendezvous options; raise :class:`LaunchError` with the offending flag."""
    if nnodes is not None:
        _check_nnodes(nnodes)
    if node_rank is not None:
        if node_rank < 0:
            raise LaunchError(f"--node-rank must be >= 0, got {node_rank}")
        if nnodes is not None and ":" not in str(nnodes) and node_rank >= int(nnodes):
            raise LaunchError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise LaunchError(f"--master-port must be in 1..65535, got {master_port}")
    if max_restarts is not None and max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {max_restarts}")


def torchrun_args(
    nproc: int,
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    *,
    nnodes: int | str | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    rdzv_conf: str | None = None,
    max_restarts: int | None = None,
) -> list[str]:
    """Build the argument list for ``python -m torch.distributed.run`` (without the interpreter part).

    Args:
        nproc: worker processes on this node (``--nproc-per-node``), at least 1.
        script: the training script; it is not checked here (see :func:`launch`).
        script_args: arguments for the script, passed after it verbatim.
        nnodes, node_rank, master_addr, master_port, rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf: torchrun's
            rendezvous flags (``rdzv_conf``: e.g. ``"last_call_timeout=5,keep_alive_interval=1"``). When all are
            ``None`` the launch is single-machine (``--standalone``); otherwise the given ones are passed through
            and ``--standalone`` is omitted.
        max_restarts: torchrun's ``--max-restarts`` (allowed with either mode).

    Returns:
        e.g. ``["--standalone", "--nproc-per-node", "2", "--", "train.py", "--steps", "5"]``.

    Raises:
        LaunchError: ``nproc < 1``, a malformed ``nnodes``, a negative or out-of-range ``node_rank``,
            a port outside 1..65535, or negative ``max_restarts``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(f"-n/--nproc-per-node must be an integer >= 1, got {nproc!r}")
    _check_rdzv(nnodes, node_rank, master_port, max_restarts)
    rdzv = {
        "nnodes": nnodes,
        "node_rank": node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "rdzv_backend": rdzv_backend,
        "rdzv_endpoint": rdzv_endpoint,
        "rdzv_id": rdzv_id,
        "rdzv_conf": rdzv_conf,
    }
    given = {k: v for k, v in rdzv.items() if v is not None}
    args = [] if given else ["--standalone"]
    args += ["--nproc-per-node", str(nproc)]
    for key in _RDZV_FLAGS:
        if key in given:
            args += ["--" + key.replace("_", "-"), str(given[key])]
    if max_restarts is not None:
        args += ["--max-restarts", str(max_restarts)]
    # "--" keeps torchrun's parser off the script's arguments (an argument such as "--node" would otherwise
    # be rejected as an ambiguous abbreviation of torchrun's own "--node-rank").
    return [*args, "--", os.fspath(script), *script_args]


def torchrun_command(args: Sequence[str], python: str | None = None) -> list[str]:
    """The full command line: ``[python, "-m", "torch.distributed.run", *args]`` (default: this interpreter)."""
    return [python or sys.executable, "-m", "torch.distributed.run", *args]


def worker_env(
    base: Mapping[str, str] | None = None,
    *,
    cluster: str | os.PathLike | None = None,
    threads: int | None = None,
    node: str | None = None,
) -> dict[str, str]:
    """The environment for torchrun and its workers.

    Starts from ``base`` (default ``os.environ``), exports ``WHALE_CLUSTER`` as the absolute path of
    ``cluster`` (which must be an existing file), and sets ``OMP_NUM_THREADS`` to ``threads`` if given,
    else to 1 unless ``base`` already sets it. ``node`` becomes ``WHALE_NODE`` (the spec node these workers run
    on, :mod:`whale.runtime.elastic`).

    Raises:
        LaunchError: the cluster spec does not exist or is not a file, or ``threads < 1``.
    """
    env = dict(os.environ if base is None else base)
    if cluster is not None:
        path = Path(cluster).expanduser()
        if not path.is_file():
            raise LaunchError(f"--cluster: cluster spec {os.fspath(cluster)!r} does not exist or is not a file")
        env["WHALE_CLUSTER"] = str(path.resolve())
    if node is not None:
        if not str(node):
            raise LaunchError("--node-name must name a node of the cluster spec, got ''")
        env["WHALE_NODE"] = str(node)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise LaunchError(f"--threads must be an integer >= 1, got {threads!r}")
        env["OMP_NUM_THREADS"] = str(threads)
    elif not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"
    return env


def _check_script(script: str | os.PathLike) -> None:
    """Raise :class:`LaunchError` unless ``script`` is an existing file."""
    if not Path(script).is_file():
        raise LaunchError(f"training script {os.fspath(script)!r} does not exist or is not a file")


def _exit_code(code: int) -> int:
    """Shell convention: a process killed by signal N (negative code -N) exits with 128 + N."""
    return 128 - code if code < 0 else code


def _run(args: Sequence[str], env: Mapping[str, str]) -> int:
    """Run torchrun in this process with ``env`` as the environment; return a shell-style exit code.

    In-process rather than ``python -m torch.distributed.run`` as a child: ``import whale`` has already
    paid for importing torch, which a child would pay again (seconds on a loaded machine). The workers are
    still separate processes started by torchrun. A failed worker's own exit code is returned (torchrun's
    command line would say 1), after torchrun's failure summary; SIGTERM/SIGINT/SIGHUP stop the workers
    and give 128 + signal number.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        torchrun_main(list(args))
        return 0
    except ChildFailedError as e:
        line, code = attribution.summary(e, env.get(failures.ERROR_DIR_ENV))
        print(line, file=sys.stderr, flush=True)
        return _exit_code(code) or 1
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch(
    nproc: int,
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    *,
    cluster: str | os.PathLike | None = None,
    threads: int | None = None,
    node: str | None = None,
    dry_run: bool = False,
    **rdzv,
) -> int:
    """Run ``script`` on ``nproc`` workers of this node through torchrun; return the exit code (0: success).

    ``rdzv`` takes the keyword arguments of :func:`torchrun_args` (``nnodes``, ``node_rank``, ``master_addr``,
    ``master_port``, ``rdzv_backend``, ``rdzv_endpoint``, ``rdzv_id``, ``max_restarts``); ``cluster`` and
    ``threads`` and ``node`` shape the workers' environment (:func:`worker_env`). With ``dry_run`` the command and the
    environment it adds are printed (as the equivalent ``python -m torch.distributed.run`` command line) and
    nothing runs. If a worker fails, its exit code is returned (128 + N for a worker killed by signal N).

    Raises:
        LaunchError: before anything starts, for any invalid argument, a missing script or cluster spec.
    """
    unknown = set(rdzv) - {*_RDZV_FLAGS, "max_restarts"}
    if unknown:
        raise TypeError(f"launch() got unexpected keyword arguments: {sorted(unknown)}")
    args = torchrun_args(nproc, script, script_args, **rdzv)
    _check_script(script)
    env = worker_env(cluster=cluster, threads=threads, node=node)
    try:  # an elastic agent: the workers learn MIN:MAX; a re-expanded round publishes its master address
        env.update(elastic.agent_env(rdzv.get("nnodes"), rdzv.get("rdzv_backend"), rdzv.get("rdzv_conf"), env))
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if cluster is not None and node is not None:
        check_node_size(cluster, node, nproc)
    elif cluster is not None:
        check_cluster_size(cluster, nproc, rdzv.get("nnodes"))
    if dry_run:
        cmd = torchrun_command(args)
        added = {k: v for k, v in env.items() if os.environ.get(k) != v}
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(added.items()))
        print((prefix + " " if prefix else "") + shlex.join(cmd))
        return 0
    folder = tempfile.mkdtemp(prefix="whale-errors-")  # the workers' error reports (whale.runtime.failures)
    try:
        return _run(args, {**env, failures.ERROR_DIR_ENV: folder, lifetime.LAUNCHER_PID_ENV: str(os.getpid())})
    finally:
        _tidy(folder)


def _tidy(folder: str) -> None:
    """Remove the error directory's first-error records; the directory too unless it holds traceback files (an
    ``error:`` line names them)."""
    for p in Path(folder).glob("*"):
        if p.name.startswith(("failure-", "interrupt-", "report-", "heartbeat-", ".")):
            p.unlink(missing_ok=True)
    try:
        os.rmdir(folder)
    except OSError:
        pass


def check_cluster_size(cluster: str | os.PathLike, nproc: int, nnodes: int | str | None = None) -> None:
    """Check, before any worker starts, that the cluster spec declares one device per process.

    Args:
        cluster: the spec file (``--cluster``).
        nproc: processes per node (``-n``).
        nnodes: ``--nnodes`` (``N`` or elastic ``MIN:MAX``; ``None``: one node).

    Raises:
        LaunchError: the spec does not load, or its device count is not ``nproc`` x nodes (naming both numbers
            and the fix: a spec of that many devices, or the ``-n`` that matches the spec).
    """
    try:
        devices = ClusterSpec.from_yaml(cluster).world_size
    except ClusterError as e:
        raise LaunchError(f"--cluster: {e}") from None
    low, high = (int(v) for v in (str(nnodes or 1).split(":") * 2)[:2])
    if any(devices == nproc * n for n in range(low, high + 1)):
        return
    if low == high:
        flags = f"-n {nproc}" + (f" x --nnodes {low}" if nnodes is not None else "")
        starts, want = f"{nproc * low}", f"{nproc * low}"
        fix = f" or -n {devices // low}" if devices % low == 0 else ""
    else:
        flags, starts = f"-n {nproc} x --nnodes {nnodes}", f"{nproc * low}..{nproc * high}"
        want, fix = f"{nproc} x N devices ({low} <= N <= {high})", ""
    raise LaunchError(f"--cluster {os.fspath(cluster)!r} declares {devices} devices but {flags} starts {starts} "
                      f"processes; pass a spec of {want} devices{fix}")


def check_node_size(cluster: str | os.PathLike, node: str, nproc: int) -> None:
    """Check, before any worker starts, that spec node ``node`` exists and declares ``nproc`` devices (an elastic
    agent runs one node's workers; :mod:`whale.runtime.elastic`).

    Raises:
        LaunchError: the spec does not load, names no such node, or the node declares another device count.
    """
    try:
        spec = ClusterSpec.from_yaml(cluster)
        elastic.present_cluster(spec, [str(node)] * nproc)
    except ClusterError as e:
        raise LaunchError(f"--cluster {os.fspath(cluster)!r} --node-name {node}: {e}") from None
