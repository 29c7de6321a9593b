"""Run a function on N gloo ranks in fresh processes (forkserver with torch preloaded), with a timeout.

Plain ``fork`` deadlocks once the parent has run a threaded op, and ``torchrun`` per test costs seconds; the
forkserver starts once per test session and forks ranks from a process that has already imported torch.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import tempfile
import traceback

_CTX = mp.get_context("forkserver")
# transformers and the two model families the tests build, when installed: importing them costs every rank of
# an HF test ~4.5 s of CPU (4 ranks on 2 cores: ~9 s of wall time per test)
_HF = ["transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"] \
    if importlib.util.find_spec("transformers") is not None else []
# Whale's runtime and parallel layers (``import whale`` loads them lazily; ~0.13 s of CPU) and what the export
# capture's trace imports (aot_autograd, the partitioner and its networkx, sympy; ~0.3 s): every rank of every
# test imported them again
_LAZY = ["torch.export._trace", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
         "whale.runtime.engine", "whale.runtime.checkpoint", "whale.runtime.ckpt_io", "whale.runtime.parallelize",
         "whale.parallel", *(["whale.parallel.split_hf"] if _HF else [])]
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.testing", "whale",
                             *_HF, *_LAZY])


def _worker(fn, rank, world, init_file, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        except RuntimeError as exc:  # before fn ran: run_ranks starts the ranks again (see INIT_RETRIES)
            if _MESH_FAILED not in str(exc):
                raise
            queue.put((rank, "init_error", traceback.format_exc()))
            return
        result = fn(rank, world, *args)
        # by value: a tensor put on the queue as is would be shared through this process's memory, which is
        # gone once the rank exits, before the parent has read it
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


INIT_RETRIES = 1
"""Times :func:`run_ranks` starts all ranks again when gloo's connection set-up failed ("Gloo connectFullMesh
failed ... Connection closed by peer"), in ``init_process_group`` or in a ``new_group`` of the test's function (then
the function runs again from the start on fresh ranks): seen about once in 850 tests on a loaded 2-core host, in a
fresh file store, from gloo's TCP mesh set-up itself (its own issue: Whale's runtime does not retry it)."""

_MESH_FAILED = "Gloo connectFullMesh failed"


def run_ranks(fn, world: int, *args, timeout: float = 60.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results ordered by rank.

    ``fn`` must be a module-level function (it is pickled by reference). Raises ``RuntimeError`` with the
    failing rank's traceback, or on timeout (all ranks are then killed so a hang fails instead of freezing).
    A gloo mesh set-up failure inside ``init_process_group`` starts every rank again, :data:`INIT_RETRIES` times.
    """
    for attempt in range(INIT_RETRIES + 1):
        try:
            return _run_once(fn, world, args, timeout)
        except _MeshSetupError as exc:
            if attempt == INIT_RETRIES:
                raise RuntimeError(str(exc)) from None
    raise AssertionError("unreachable")


class _MeshSetupError(Exception):
    """gloo's connectFullMesh failed in ``init_process_group`` on some rank (the message: its traceback)."""


def _run_once(fn, world: int, args: tuple, timeout: float) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        queue = _CTX.Queue()
        procs = [_CTX.Process(target=_worker, args=(fn, r, world, init_file, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            for _ in range(world):
                rank, status, payload = queue.get(timeout=timeout)
                if status == "init_error" or (status == "error" and _MESH_FAILED in payload):
                    raise _MeshSetupError(f"rank {rank} failed setting up gloo's connections:\n{payload}")
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                results[rank] = pickle.loads(payload)
        except Exception as exc:
            if isinstance(exc, _MeshSetupError):
                for p in procs:
                    p.kill()
                raise
            if not isinstance(exc, RuntimeError):
                what = f"timed out after {timeout}s" if isinstance(exc, queue_mod.Empty) else f"failed: {exc!r}"
                exc = RuntimeError(f"distributed test {what} (got ranks {sorted(results)})")
            for p in procs:
                p.kill()
            raise exc from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return [results[r] for r in range(world)]
