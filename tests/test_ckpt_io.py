"""Checkpoint I/O that scales (issue 24, item 7): saves spread over every rank, each file hashed by its writer
while written, each loading rank hashing only the byte ranges it reads, a corrupted range named by the rank
that reads it, the earlier format still loading."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import whale as wh
from tests.distributed import run_ranks
from tests.reshard_models import batches, engine, save_layout, whole_state
from whale.runtime import ckpt_io
from whale.runtime import ckpt_store as store


def _manifest(root: Path) -> dict:
    return json.loads(next(root.glob("step-*/whale.json")).read_text())


def _share(info: dict) -> float:
    """The busiest rank's share of the checkpoint's bytes (every file, by the writer the manifest names)."""
    per: dict[int, int] = {}
    for e in info["files"].values():
        per[e["rank"]] = per.get(e["rank"], 0) + e["bytes"]
    return max(per.values()) / sum(per.values())


def _no_file_hashing(*_a, **_k):
    raise AssertionError("a checkpoint file was hashed by reading it back")


def _corrupt_copy(root: Path, bad: Path, prefix: str) -> tuple[str, list, int]:
    """Copy ``root`` to ``bad`` and flip one byte inside the first tensor whose key starts with ``prefix``;
    returns the file, the chunk and its writer."""
    shutil.copytree(root, bad)
    ckpt = next(bad.glob("step-*"))
    for name, e in _manifest(bad)["files"].items():
        chunk = next((c for c in e.get("chunks", ()) if c[3] and c[3].startswith(prefix)), None)
        if chunk is not None:
            data = bytearray((ckpt / name).read_bytes())
            data[chunk[0] + chunk[1] // 2] ^= 0xFF
            (ckpt / name).write_bytes(data)
            return name, chunk, e["rank"]
    raise AssertionError(f"no tensor {prefix}*")


def _save_reload_corrupt(rank, world, root):
    """DP2 x PP2: train 2 steps, save (no file hashed by reading it back anywhere), reload into a fresh engine
    recording the files opened and the ranges hashed, then load a copy with one stage-1 tensor corrupted."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("dp2pp2", ctx)
    for b in batches(2):
        e.step(b)
    before = whole_state(e)
    store._sha256 = _no_file_hashing
    e.save_checkpoint(root)
    opened, hashed = set(), []
    plain_open, plain_verify = FileSystem.create_stream, ckpt_io.verify_chunk

    @contextmanager
    def recording_open(self, path, mode):
        if "r" in mode:
            opened.add(Path(path).name)
        with plain_open(self, path, mode) as stream:
            yield stream

    def recording_verify(f, chunk, writer, data):
        hashed.append((f.name, chunk[0], chunk[3]))
        plain_verify(f, chunk, writer, data)

    FileSystem.create_stream, ckpt_io.verify_chunk = recording_open, recording_verify
    again = engine("dp2pp2", ctx, seed=100)
    again.load_checkpoint(root)
    after = whole_state(again)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ckpt_io.verify_chunk = plain_verify
    bad = f"{root}-bad"
    corrupted = _corrupt_copy(Path(root), Path(bad), "model/blocks.3.") if rank == 0 else None
    dist.barrier()
    try:
        engine("dp2pp2", ctx, seed=100).load_checkpoint(bad)
        error = None
    except wh.CheckpointError as exc:
        error = str(exc)
    return {"rank": rank, "stage": e.stage, "same": same, "keys": sorted(after), "opened": opened, "hashed": hashed,
            "error": error, "corrupted": corrupted}


@pytest.fixture(scope="module")
def dpxpp(tmp_path_factory):
    root = tmp_path_factory.mktemp("io") / "c"
    return root, run_ranks(_save_reload_corrupt, 4, str(root), timeout=180)


def test_dp_x_pp_save_spreads_bytes_and_is_hashed_by_its_writers(dpxpp):
    root, ranks = dpxpp
    assert all(r["same"] for r in ranks)  # the reload is bitwise
    info = _manifest(root)
    assert info["format"] == "whale-dcp-2"
    assert _share(info) <= 1.5 / 4, _share(info)
    data = {n: e for n, e in info["files"].items() if n.endswith(".distcp")}
    assert sorted(e["rank"] for e in data.values()) == [0, 1, 2, 3]  # every rank writes its own file
    for name, e in data.items():
        assert name.startswith(f"__{e['rank']}_")  # the entry (with its digests) came from the file's writer
        assert sum(c[1] for c in e["chunks"]) == e["bytes"]  # the chunks cover the file
    store.read_manifest(next(root.glob("step-*")))  # the writers' digests match the files, read whole here


def test_a_loading_rank_hashes_only_the_ranges_it_reads(dpxpp):
    root, ranks = dpxpp
    info = _manifest(root)
    every = {(n, c[0], c[3]) for n, e in info["files"].items() for c in e.get("chunks", ())}
    for r in ranks:
        assert len(r["hashed"]) == len(set(r["hashed"]))  # each range hashed once, as it is read
        assert set(r["hashed"]) <= every
        assert {key for _, _, key in r["hashed"]} == set(r["keys"])  # exactly this rank's tensors
        assert {name for name, _, _ in r["hashed"]} <= r["opened"]
        assert len(r["hashed"]) < len(every)  # a stage never hashes the other stage's tensors
    stage0 = [r for r in ranks if r["stage"] == 0]
    assert stage0 and all(not any(k.startswith("model/blocks.3.") for _, _, k in r["hashed"]) for r in stage0)


def test_a_corrupted_tensor_is_named_by_the_ranks_that_read_it(dpxpp):
    """Only stage 1 reads (and so hashes) blocks.3; the load's agreement (ckpt_runs.load_first_intact) then
    stops every rank with the same line, naming the range, the tensor, its writer and the rank that found it."""
    _, ranks = dpxpp
    name, (off, length, _, key), writer = ranks[0]["corrupted"]
    finder = min(r["rank"] for r in ranks if r["stage"] == 1)
    assert len({r["error"] for r in ranks}) == 1  # the same error on every rank, stage 0 included
    assert f"{name} is corrupted: bytes {off}-{off + length} ({key}, {length} bytes, written by rank " \
           f"{writer}) differ from the manifest's SHA-256 (rank {finder})" in ranks[0]["error"]


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_save_spreads_bytes(tmp_path, world):
    run_ranks(save_layout, world, "dp4", str(tmp_path), timeout=120)  # no annotation: data parallel
    info = _manifest(tmp_path / "dp4")
    assert _share(info) <= 1.5 / world, _share(info)
    assert len([n for n in info["files"] if n.endswith(".distcp")]) == world


def _load_old_and_unknown(rank, world, old, unknown):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("one", ctx, seed=3)
    extra = e.load_checkpoint(old)
    try:
        engine("one", ctx).load_checkpoint(unknown)
        error = None
    except wh.CheckpointError as exc:
        error = str(exc)
    return extra, e.steps_done, whole_state(e), error


def test_the_earlier_format_loads_and_an_unknown_one_is_refused(tmp_path):
    saved = run_ranks(save_layout, 1, "one", str(tmp_path), timeout=120)
    ckpt = next((tmp_path / "one").glob("step-*"))
    info = _manifest(tmp_path / "one")
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)  # whale-dcp-1: rank 0 hashed every file whole after the save
    files = {n: {"bytes": (old / n).stat().st_size, "sha256": store._sha256(old / n)} for n in info["files"]}
    (old / store.MARKER).write_text(json.dumps({**info, "format": "whale-dcp-1", "files": files}))
    unknown = tmp_path / "unknown"
    shutil.copytree(ckpt, unknown)
    (unknown / store.MARKER).write_text(json.dumps({**info, "format": "whale-dcp-9"}))
    [(extra, step, state, error)] = run_ranks(_load_old_and_unknown, 1, str(old), str(unknown), timeout=120)
    assert extra == {"position": 2} and step == 2
    want = saved[0]["state"]
    assert state.keys() == want.keys() and all(torch.equal(state[k], v) for k, v in want.items())
    assert error == (f"checkpoint {unknown} has format 'whale-dcp-9', which this Whale version does not read (it "
                     "reads whale-dcp-2, whale-dcp-1); load it with the Whale version that wrote it")


def test_spread_puts_each_item_on_one_holder_largest_first():
    """Process-free: three ranks, rank 0 and 1 hold the same tensors; rank 2 its own."""
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    same = {f"t{i}": torch.zeros(n) for i, n in enumerate([1000, 10, 600, 500])}
    plans = [create_default_local_save_plan(same, True), create_default_local_save_plan(same, False),
             create_default_local_save_plan({"own": torch.zeros(50)}, False)]
    out = ckpt_io.spread(plans)
    keys = [sorted(it.index.fqn for it in p.items) for p in out]
    assert keys == [["t2", "t3"], ["t0", "t1"], ["own"]]  # rank 0 starts with its .metadata bytes
