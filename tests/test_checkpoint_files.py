"""Checkpoint files (issue 15): a save killed midway leaves the previous one loadable, damaged files are named,
stale files are never read, export loads into the unannotated model, a failed rank ends its peers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import whale as wh
from tests.distributed import run_ranks
from tests.reshard_models import ReshardNet, batches, engine, save_layout

ROOT = Path(__file__).resolve().parents[1]

_KILLED_SAVE = """
import os, signal, sys
import whale as wh
from whale.runtime import ckpt_store
from tests.reshard_models import batches, engine
ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
e = engine("one", ctx)
e.step(batches(1)[0])
e.save_checkpoint(sys.argv[1])
e.step(batches(2)[1])
if sys.argv[2] == "kill":  # kill -9 once the new step's data files are written, before it is published
    ckpt_store.publish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
else:
    def fail(*a, **k):
        raise RuntimeError("disk full")
    ckpt_store.publish = fail
e.save_checkpoint(sys.argv[1])
"""


def _reload(rank, world, path):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("one", ctx, seed=3)
    e.load_checkpoint(path)
    ref = engine("one", ctx)
    ref.step(batches(1)[0])  # what the first (complete) save held
    same = all(torch.equal(a, b) for a, b in zip(e.module.state_dict().values(), ref.module.state_dict().values(),
                                                 strict=True))
    return e.steps_done, same


@pytest.mark.parametrize("how", ["kill", pytest.param("raise", marks=pytest.mark.slow)])
def test_a_torn_save_leaves_the_previous_checkpoint_loadable(tmp_path, how):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "c"), how], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == (-9 if how == "kill" else 1), proc.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == [".tmp-step-00000002", "latest", "step-00000001"]
    assert (tmp_path / "c" / ".tmp-step-00000002" / ".metadata").exists()  # the new data was written, not published
    assert wh.latest_checkpoint(tmp_path / "c") == str(tmp_path / "c" / "step-00000001")
    [(step, same)] = run_ranks(_reload, 1, str(tmp_path / "c"), timeout=120)
    assert step == 1 and same


def _save_split(rank, world, root):
    return save_layout(rank, world, "split2", root)


@pytest.fixture(scope="module")
def split_ckpt(tmp_path_factory):
    """A checkpoint of the split layout (2 ranks, uneven head shards) and what it saved."""
    root = tmp_path_factory.mktemp("split")
    saved = run_ranks(_save_split, 2, str(root), timeout=120)
    return root / "split2", saved


def _damage(src: Path, dst: Path, name: str, how: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    f = next(dst.glob(f"step-*/{name}"))
    data = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(data)
    return f


@pytest.mark.parametrize(("name", "how", "says"), [("__0_0.distcp", "truncate", "truncated"),
                                                   (".metadata", "flip", "corrupted"),
                                                   ("whale.pt", "flip", "corrupted")])
def test_a_damaged_file_is_named(split_ckpt, tmp_path, name, how, says):
    from whale.checkpoint_cli import export

    bad = _damage(split_ckpt[0], tmp_path / "c", name, how)
    with pytest.raises(wh.CheckpointError, match=says) as info:
        export(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))
    assert str(bad) in str(info.value)


def test_export_loads_into_the_unannotated_model_strictly(split_ckpt, tmp_path):
    path, saved = split_ckpt
    out = tmp_path / "m.safetensors"
    from whale.cli import main

    assert main(["checkpoint", "export", str(path), str(out)]) == 0
    model = ReshardNet("one")
    model.load_state_dict(load_file(out), strict=True)
    assert model.lm.weight is model.emb.weight  # the tie survives a strict load
    whole = saved[0]["state"]
    for name, t in model.state_dict().items():
        assert torch.equal(t, whole[f"model/{name}"]), name
    from whale.checkpoint_cli import inspect

    text = inspect(str(path))
    assert "step 2, saved by 2 rank(s)" in text and "nested split(2): head" in text
    assert "head.weight" in text and "[10, 32]" in text


def test_stale_and_unfinished_files_are_never_read(split_ckpt, tmp_path):
    import shutil

    root = tmp_path / "c"
    shutil.copytree(split_ckpt[0], root)
    (root / "rank00003.pt").write_bytes(b"stale shard of a 4-rank run")
    (root / ".tmp-step-00000009").mkdir()
    (root / ".tmp-step-00000009" / "__0_0.distcp").write_bytes(b"unfinished")
    (root / "step-00000007").mkdir()  # no manifest: incomplete
    (root / "latest").write_text("step-00000007\n")  # a pointer to an incomplete one is not followed
    assert wh.latest_checkpoint(root) == str(root / "step-00000002")
    empty = tmp_path / "old"
    empty.mkdir()
    (empty / "rank00000.pt").write_bytes(b"old format")
    with pytest.raises(wh.CheckpointError, match="older Whale format"):
        from whale.runtime.ckpt_store import resolve

        resolve(empty)


def _hung_peer(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, timeout_s=3))
    e = engine("split2", ctx)
    if rank == 1:
        time.sleep(8)  # raised in its own code and never reaches the step's collectives
        return None
    start = time.perf_counter()
    try:
        e.step(batches(1)[0])
    except Exception as exc:  # noqa: BLE001 - the collective's timeout
        return time.perf_counter() - start, type(exc).__name__
    return None


def test_a_rank_left_waiting_stops_within_the_timeout():
    waited, _ = run_ranks(_hung_peer, 2, timeout=60)[0]
    assert 2.5 < waited < 3 + 4  # the timeout, not the peer leaving (at 8 s)


def test_config_refuses_a_bad_timeout():
    with pytest.raises(wh.ConfigError, match="timeout_s"):
        wh.Config(timeout_s=0)


@pytest.mark.slow
def test_a_raising_rank_ends_the_launched_job_and_its_error_is_printed_once():
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "whale.cli", "launch", "-n", "2", str(ROOT / "benchmarks/_raise_job.py"),
           "--raise-rank", "1", "--raise-step", "2", "--timeout", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    end = time.time()
    raised = float(out.split("RAISE_AT ")[1].split()[0])
    assert proc.returncode == 1 and end - raised < 5 + 10
    assert out.count("RuntimeError: injected failure on rank 1") == 1
    assert "rank 1 failed first (exit code 1)" in out
