"""``whale.init``: join (or create) the process group and fix the RNG so every replica starts equal.

Seeding rule (the whole of it in :mod:`whale.runtime.rng`): :func:`init` seeds torch's default generators with
``Config.seed`` on every rank, so models built next are identical, and Whale never reseeds them afterwards: they
stay the user's streams, the same on every rank (data drawn with them is the same global batch everywhere). The
engine's forwards draw from per-lane, per-split-group and per-shard streams derived from ``Config.seed``, swapped
in around those forwards only.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from whale.cluster import ClusterSpec
from whale.config import Config
from whale.frontend.planning import resolve_cluster
from whale.runtime import elastic, failures, heartbeat, lifetime

DEFAULT_TIMEOUT_S = 600.0
"""The collective timeout when ``Config.timeout_s`` is ``None``: 10 minutes (gloo's own default is 30)."""


@dataclass(frozen=True)
class Context:
    """What a rank knows after :func:`init`: its config, rank, world size, compute device and cluster spec
    (``None`` when the job runs on CPUs without a spec: devices are then taken as identical)."""

    config: Config
    rank: int
    world_size: int
    device: torch.device
    cluster: ClusterSpec | None = None

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that prints and writes reports)."""
        return self.rank == 0


_CURRENT: list[Context] = []


def init(config: Config | None = None) -> Context:
    """Initialize Whale on this process and return its :class:`Context`.

    Joins the ``torch.distributed`` process group that ``torchrun``/``whale launch`` describes through the
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), or, when started as a plain script, creates a
    one-process group. Backend: ``config.backend`` or NCCL when CUDA is available, else gloo. Seeds torch's
    default CPU and CUDA generators with ``config.seed`` on every rank so models built next are identical
    (training forwards draw from streams of their own: see :mod:`whale.runtime.rng`). If a process group
    already exists (tests, or a user who created it), it is reused. ``config.timeout_s`` (default 10 minutes)
    becomes the collective timeout of the group and of every group created after it. Under ``whale launch`` or
    torchrun the worker dies with its launcher (:mod:`whale.runtime.lifetime`) and writes heartbeats
    (:mod:`whale.runtime.heartbeat`).

    The returned context is also remembered as the default for :func:`whale.parallelize` (the way
    ``torch.distributed`` remembers its default group); pass ``ctx=`` there to be explicit.
    """
    config = config or Config()
    if config.cluster is None and os.environ.get("WHALE_CLUSTER"):
        config = config.replace(cluster=os.environ["WHALE_CLUSTER"])
    cuda = torch.cuda.is_available() and config.backend != "gloo"
    backend = config.backend or ("nccl" if cuda else "gloo")
    lifetime.exit_with_parent()  # a worker of a launcher that died exits (whale.runtime.lifetime)
    timeout = _default_timeout(config)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **_restart_store())
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif config.timeout_s:  # a group made by the caller: its collectives get this timeout from now on
        dist.distributed_c10d._set_pg_timeout(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    failures.install(rank, world)  # one error line per failing rank, one traceback (whale.runtime.failures)
    if world > 1:
        heartbeat.start(rank)  # this rank's step and phase for the launcher (whale.runtime.heartbeat)
    if not _TEARDOWN:
        _TEARDOWN.append(atexit.register(teardown))
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    torch.manual_seed(config.seed)
    cluster = elastic.resolve(config.cluster, world)  # an elastic job: the spec's nodes present now (collective)
    ctx = Context(config, rank, world, device, resolve_cluster(cluster, world))
    _CURRENT[:] = [ctx]
    return ctx


def _default_timeout(config: Config) -> timedelta:
    """``config.timeout_s`` (else :data:`DEFAULT_TIMEOUT_S`) as the timeout of the world group and of every group
    created after it: torch gives ``new_group`` (Whale's meshes, ``DeviceMesh``, checkpointing) its own default
    (30 min on gloo) unless told, so the module default that ``new_group`` reads is set too."""
    timeout = timedelta(seconds=config.timeout_s or DEFAULT_TIMEOUT_S)
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout
    return timeout


_TEARDOWN: list = []


def teardown(quiet_timeout_s: float = 2.0) -> None:
    """End this process's distributed state before the interpreter finalizes (``wh.init`` registers it with
    :mod:`atexit`; calling it earlier is allowed, once the job's last collective has returned).

    Why: a gloo worker thread releases each collective's work (and its tensors) just *after* the collective
    returned to Python. When the script ends right then, the interpreter may already be finalizing: the thread's
    release of a tensor whose Python object is gone takes the GIL, Python ends the thread (``pthread_exit``)
    inside a ``noexcept`` destructor, and the process dies with ``terminate called without an active
    exception`` (exit code 134), a successful run reported as failed. So, with the interpreter still whole
    (the heartbeat thread stopped first):

    1. wait (with the GIL released, at most ``quiet_timeout_s``) until no thread but this one is running, so every
       worker has released its last work, for the groups Whale's objects still hold as well;
    2. ``destroy_process_group()`` unless the user already did or this rank is exiting on an error (a peer may be
       gone and a group's destructor waits for queued work): the groups only torch held are destroyed, their
       worker threads joined.
    """
    heartbeat.stop()
    _wait_until_quiet(quiet_timeout_s)
    if dist.is_available() and dist.is_initialized() and not failures.reported():
        dist.destroy_process_group()


def _wait_until_quiet(timeout_s: float, samples: int = 3) -> None:
    """Sleep in steps of 1 ms until ``samples`` consecutive looks at ``/proc/self/task`` find no thread but this
    one runnable (state R), or ``timeout_s`` passed; returns at once where ``/proc`` does not exist."""
    me = threading.get_native_id()
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < samples and time.monotonic() < deadline:
        time.sleep(0.001)
        try:
            running = [t for t in os.listdir("/proc/self/task") if int(t) != me and _state(t) == "R"]
        except OSError:
            return
        quiet = 0 if running else quiet + 1


def _state(tid: str) -> str:
    """The scheduler state letter of thread ``tid`` of this process ('' when it is gone)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _restart_store() -> dict:
    """Under torchrun after an elastic restart (``TORCHELASTIC_RESTART_COUNT`` > 0), the agent's store with a
    prefix of this attempt, as ``init_process_group`` arguments: the restarted workers otherwise share the keys
    of the failed attempt and gloo tries to connect to the dead workers' addresses ("Connection refused")."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return {"store": dist.PrefixStore(f"/whale/{run}/attempt_{attempt}", store), "rank": rank, "world_size": world}


def current_context() -> Context:
    """The context made by the latest :func:`init` (calls ``init()`` with defaults if there is none)."""
    return _CURRENT[0] if _CURRENT else init()
