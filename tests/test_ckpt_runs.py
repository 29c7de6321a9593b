"""Checkpoint runs (issue 24): two runs in one directory, pruning by publish order, fallback from a damaged
latest checkpoint, full and read-only disks, no leaked temporary copies."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.reshard_models import batches, engine
from whale.runtime import checkpoint, ckpt_io, ckpt_runs, ckpt_store

_OTHER = r"checkpoint directory '.*' holds the checkpoints of another run \(\S+: steps 2-3\); a new run never prunes"


def _local(e) -> dict:
    return {k: v.clone() for k, v in e.module.state_dict().items()}


def _two_runs(rank, world, root):
    """Run A saves steps 2 and 3; run B (fresh) is refused, then claims with overwrite and saves steps 1, 2;
    run C resumes B and saves step 3."""
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    data = batches(3)
    a = engine("split2", ctx)
    for i, b in enumerate(data):
        a.step(b)
        if i:
            a.save_checkpoint(root)
    b_run = engine("split2", ctx, seed=1)
    b_run.step(data[0])
    try:
        b_run.save_checkpoint(root)
        refused = None
    except wh.CheckpointError as exc:
        refused = str(exc)
    note = wh.claim_checkpoint_dir(b_run, root, overwrite=True)
    b_run.save_checkpoint(root)
    b_run.step(data[1])
    b_run.save_checkpoint(root)
    saved_b = _local(b_run)
    names_b = sorted(p.name for p in Path(root).iterdir())
    c = engine("split2", ctx, seed=2)
    c.load_checkpoint(root)
    same = all(torch.equal(v, saved_b[k]) for k, v in c.module.state_dict().items())
    c.step(data[2])
    c.save_checkpoint(root)
    return {"refused": refused, "note": note, "names_b": names_b, "same": same, "runs": (a.run_id, b_run.run_id,
            c.run_id), "final": sorted(p.name for p in Path(root).iterdir())}


def test_two_runs_in_one_directory_never_lose_a_checkpoint(tmp_path):
    """World 2: a fresh run in a directory holding another run's later steps is refused on every rank; with
    overwrite its own checkpoints survive pruning (the old run's higher steps are removed, said once); a resumed
    run adopts the run id and continues it."""
    r0, r1 = run_ranks(_two_runs, 2, str(tmp_path / "c"), timeout=120)
    assert r0["refused"] == r1["refused"] and re.fullmatch(_OTHER + r".*--overwrite.*", r0["refused"])
    a_run, b_run, c_run = r0["runs"]
    assert r0["runs"] == r1["runs"] and a_run != b_run == c_run
    assert re.fullmatch(rf".*/c: removed 2 checkpoint\(s\) of run\(s\) {a_run} \(steps 2-3\) to start afresh",
                        r0["note"]) and r1["note"] == r0["note"]
    assert r0["names_b"] == ["latest", "step-00000001", "step-00000002"] and r0["same"] and r1["same"]
    assert r0["final"] == ["latest", "step-00000002", "step-00000003"]
    info = json.loads((tmp_path / "c" / "step-00000003" / "whale.json").read_text())
    assert (info["run"], info["published"]) == (b_run, 2)
    assert (tmp_path / "c" / "latest").read_text().strip() == "step-00000003"


def _fake(root: Path, step: int, run: str, published: int | None) -> None:
    d = root / ckpt_store.step_name(step)
    d.mkdir(parents=True)
    info = {"step": step, "files": {}, "run": run}
    if published is not None:
        info["published"] = published
    (d / ckpt_store.MARKER).write_text(json.dumps(info))


def test_pruning_keeps_the_newest_by_publish_order(tmp_path):
    """No processes: a run whose later publishes have lower steps keeps those (not the highest steps); another
    run's checkpoint and the one 'latest' names are never removed."""
    for step, pub in [(10, 0), (8, 1), (5, 2), (3, 3)]:
        _fake(tmp_path, step, "r", pub)
    _fake(tmp_path, 99, "other", 7)
    (tmp_path / "latest").write_text("step-00000010\n")
    ckpt_runs.prune(tmp_path, "r", 2, tmp_path / "step-00000003")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000005",
                                                         "step-00000010", "step-00000099"]
    (tmp_path / "latest").write_text("step-00000003\n")
    ckpt_runs.prune(tmp_path, "r", 2, tmp_path / "step-00000003")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000005",
                                                         "step-00000099"]
    (tmp_path / "latest").unlink()  # without the pointer: the newest published (not the highest step) wins
    shutil.rmtree(tmp_path / "step-00000099")
    assert ckpt_store.latest(tmp_path).name == "step-00000003"


def test_a_same_step_save_and_a_killed_one_leave_no_temporary_copies(tmp_path):
    """No processes: saving a step again replaces it without leaving ``.tmp-old-step-N``; one a kill left (and an
    unfinished ``.tmp-step-N``) is removed by the next save."""
    for _ in range(2):
        tmp = ckpt_store.begin(tmp_path, 4)
        (tmp / "x").write_bytes(b"data")
        ckpt_store.publish(tmp_path, 4, {"run": "r", "published": 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004"]
    (tmp_path / ".tmp-old-step-00000004").mkdir()
    (tmp_path / ".tmp-step-00000003").mkdir()
    ckpt_store.begin(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-00000005", "latest", "step-00000004"]


def _save_two(rank, world, root):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("split2", ctx)
    states = []
    for b in batches(2):
        e.step(b)
        e.save_checkpoint(root)
        states.append(_local(e))
    return states


@pytest.fixture(scope="module")
def two_ckpts(tmp_path_factory):
    """Steps 1 and 2 of one run (split2 on 2 ranks, uneven head shards) and each rank's state after each."""
    root = tmp_path_factory.mktemp("two") / "c"
    return root, run_ranks(_save_two, 2, str(root), timeout=120)


def _load(rank, world, root):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("split2", ctx, seed=3)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        e.load_checkpoint(root)
    return e.steps_done, _local(e), err.getvalue()


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(data)


def test_a_corrupted_latest_falls_back_to_the_previous_once_on_rank_0(two_ckpts, tmp_path):
    """World 2: the newest checkpoint's data file is corrupted; every rank loads step 1 (its exact state) and
    rank 0 alone says once which it skipped and why."""
    src, states = two_ckpts
    root = tmp_path / "c"
    shutil.copytree(src, root)
    _flip(root / "step-00000002" / "__0_0.distcp")
    r0, r1 = run_ranks(_load, 2, str(root), timeout=120)
    for rank, (step, state, _) in enumerate((r0, r1)):
        assert step == 1 and all(torch.equal(v, states[rank][0][k]) for k, v in state.items())
    assert re.fullmatch(r"checkpoint: skipped step-00000002 \(checkpoint file .*/step-00000002/__0_0\.distcp is "
                        r"corrupted: bytes \d+-\d+ \(\S+, \d+ bytes, written by rank 0\) differ from the manifest's "
                        r"SHA-256 \(rank \d\)\); loading step-00000001, the newest intact checkpoint of run \S+ in "
                        r".*/c\n", r0[2])
    assert r1[2] == ""


def _verify(d):
    return ckpt_store.read_manifest(d), checkpoint.read_meta(d)


@pytest.mark.parametrize(("damage", "says"), [
    ("manifest", r"no manifest \(whale\.json\): an incomplete or damaged save"),
    ("truncate", r"checkpoint file .*whale\.pt is truncated or altered: \d+ bytes, the manifest says \d+"),
    ("delete", r"checkpoint file .*\.metadata is missing: the checkpoint is damaged")])
def test_a_damaged_latest_is_skipped_with_a_word(two_ckpts, tmp_path, capsys, damage, says):
    """No processes (the verification alone): a missing manifest, a truncated or a deleted file of the newest
    checkpoint makes loading take the previous one, with the reason."""
    root = tmp_path / "c"
    shutil.copytree(two_ckpts[0], root)
    d = root / "step-00000002"
    if damage == "manifest":
        (d / "whale.json").unlink()
    elif damage == "truncate":
        (d / "whale.pt").write_bytes((d / "whale.pt").read_bytes()[:10])
    else:
        (d / ".metadata").unlink()
    found, (info, _) = ckpt_runs.load_first_intact(root, _verify, 0)
    assert found.name == "step-00000001" and info["step"] == 1
    assert re.fullmatch(rf"checkpoint: skipped step-00000002 \({says}\); loading step-00000001, .*\n",
                        capsys.readouterr().err)
    _flip(root / "step-00000001" / "whale.pt")  # nothing intact: one line with each reason, and what to do
    with pytest.raises(wh.CheckpointError, match=r"no checkpoint in '.*' verifies: step-00000002 \(.*\); "
                                                 r"step-00000001 \(.*whale\.pt is corrupted.*\); restore"):
        ckpt_runs.load_first_intact(root, _verify, 0)
    with pytest.raises(wh.CheckpointError, match=r"corrupted .*; pass the directory above it \('.*/c'\) to load"):
        ckpt_runs.load_first_intact(root / "step-00000001", _verify, 0)


def _disks(rank, world, root):
    """Three failing saves (no room by the free-space check; ENOSPC from DCP's writes on rank 0; EROFS from
    rank 0's whale.pt), then one that succeeds."""
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("split2", ctx)
    e.step(batches(1)[0])
    real_usage, real_save, lines = shutil.disk_usage, torch.save, []

    def fail(code, where):
        def save(obj, f, *a, **k):
            if rank == 0 and isinstance(f, str | Path) == (where == "meta"):
                raise OSError(code, errno.errorcode[code])
            return real_save(obj, f, *a, **k)
        return save

    real_meta = ckpt_io.write_meta

    def read_only(f, *a, **k):  # rank 0's whale.pt (written from memory by ckpt_io, not by torch.save(path))
        raise OSError(errno.EROFS, errno.errorcode[errno.EROFS])

    for how in ("free", "enospc", "erofs"):
        if how == "free":
            ckpt_runs.shutil.disk_usage = lambda p: real_usage(p)._replace(free=1000)
        torch.save = fail(errno.ENOSPC, "data") if how == "enospc" else real_save
        if how == "erofs" and rank == 0:
            ckpt_io.write_meta = read_only
        try:
            e.save_checkpoint(root)
            lines.append(None)
        except wh.CheckpointError as exc:
            lines.append(str(exc))
        finally:
            ckpt_runs.shutil.disk_usage, torch.save, ckpt_io.write_meta = real_usage, real_save, real_meta
    left = sorted(p.name for p in Path(root).iterdir())
    e.save_checkpoint(root)
    return lines, left, sorted(p.name for p in Path(root).iterdir())


def test_a_full_or_read_only_disk_is_one_line_on_every_rank(tmp_path):
    """World 2: a save that does not fit, one that meets ENOSPC and one that meets EROFS each raise one line on
    every rank (bytes needed and free; read-only), leave no temporary copy, and a later save works."""
    r0, r1 = run_ranks(_disks, 2, str(tmp_path / "c"), timeout=120)
    assert (r0[0][0], r0[0][2], r0[1:]) == (r1[0][0], r1[0][2], r1[1:])  # the same lines (free bytes aside)
    lines, left, after = r0
    space = (r"cannot write checkpoint step-00000001 to '.*/c': no space left on the device \(the checkpoint needs "
             r"([\d,]+) bytes \(0\.00 GiB\) and its file system has ([\d,]+) bytes \([\d.]+ GiB\) free\); free space "
             r"there or save to another directory")
    m = re.fullmatch(space, lines[0])
    assert m and m.group(2) == "1,000" and int(m.group(1).replace(",", "")) > 1000
    assert re.fullmatch(space, lines[1]) and re.fullmatch(space, r1[0][1])  # the ENOSPC of rank 0's write
    assert re.fullmatch(r"cannot write checkpoint step-00000001 to '.*/c': the file system is read-only \(EROFS\); "
                        r"pass a writable checkpoint directory", lines[2])
    assert left == [] and after == ["latest", "step-00000001"]


def _gpt_jobs(rank, world, store, data, *runs):
    """``examples/gpt/train.py``'s ``main`` once per (env, argv) in this process, each in a new gloo group (the
    job ends its group): (exit code, stdout + stderr) of each."""
    import os
    import sys

    import torch.distributed as dist

    from examples.gpt.train import main

    tiny = ["--stages", "1", "--micro-batches", "1", "--data-dir", data, "--vocab-size", "300", "--n-layer", "1",
            "--n-head", "2", "--n-embd", "16", "--seq-len", "16", "--batch-size", "4", "--eval-every", "0",
            "--eval-batches", "1", "--sample-tokens", "0", "--tensorboard", "", "--no-progress"]
    out = []
    for i, (env, argv) in enumerate(runs):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{store}{i}", rank=rank, world_size=world)
        os.environ.update(env)
        text, code = io.StringIO(), 0
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                main([*tiny, *argv])
            except SystemExit as exc:
                code = exc.code
        for k in env:
            os.environ.pop(k)
        sys.stdout.flush()
        out.append((code, text.getvalue()))
    return out


def test_the_gpt_job_refuses_another_run_overwrites_it_and_a_finished_restart_succeeds(tmp_path):
    """One process, seven tiny GPT jobs: a second fresh run in one directory is refused (exit 2, one line); with
    --overwrite its checkpoint survives; a restart of that job after its final checkpoint exits 0 naming its
    summary, or writes it again when it is gone; a step directory as --ckpt-dir is refused naming its parent;
    --resume in a directory with no checkpoint says that it starts a new run."""
    texts = tmp_path / "data" / "texts"
    texts.mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "tempest_gut.txt", texts)
    (texts / ".complete").touch()
    ck, summary = str(tmp_path / "ck"), str(tmp_path / "s.json")
    job = {"TORCHELASTIC_RUN_ID": "job-b"}
    again = {**job, "TORCHELASTIC_RESTART_COUNT": "1"}
    common = ["--ckpt-dir", ck, "--summary", summary]
    empty = str(tmp_path / "empty")
    [a, b, b2, restart, gone, step_dir, nothing] = run_ranks(
        _gpt_jobs, 1, str(tmp_path / "store"), str(tmp_path / "data"), ({}, [*common, "--steps", "2"]),
        (job, [*common, "--steps", "1"]), (job, [*common, "--steps", "1", "--overwrite"]),
        (again, [*common, "--steps", "1"]), (again, [*common, "--steps", "1", "--summary", summary + "2"]),
        ({}, ["--ckpt-dir", ck + "/step-00000001", "--steps", "2"]),
        ({}, ["--ckpt-dir", empty, "--summary", summary + "3", "--steps", "1", "--resume"]), timeout=240)[0]
    assert a[0] == 0 and "summary written to" in a[1]
    assert b[0] == 2 and re.search(r"error: CheckpointError: " + _OTHER.replace("steps 2-3", "step 2"), b[1])
    assert b2[0] == 0 and re.search(r"ck: removed 1 checkpoint\(s\) of run\(s\) \S+ \(step 2\) to start afresh", b2[1])
    assert restart[0] == 0 and f"the summary of the finished run is at {summary}\n" in restart[1]
    assert "nothing to do" in restart[1] and "held-out loss: initial" not in restart[1]
    assert gone[0] == 0 and f"no summary of the finished run at {summary}2: writing it" in gone[1]
    assert json.loads(Path(summary + "2").read_text())["steps"] == 1
    assert sorted(p.name for p in Path(ck).iterdir()) == ["latest", "step-00000001"]
    assert nothing[0] == 0 and f"--resume: no checkpoint in {empty} yet: starting a new run at step 0" in nothing[1]
    assert step_dir[0] == 2 and re.search(rf"is one checkpoint \(a step-N directory\): saving there would nest new "
                                          rf"checkpoints inside it; pass its parent '{re.escape(ck)}'", step_dir[1])


def _gpt_jobs_forward_checks(rank, world, store, data, *runs):
    """:func:`_gpt_jobs` without the job's own check of ``--seq-len`` under ``--sequence-parallel``: the bad length
    is then refused where the library cuts the sequences, in the job's first forward."""
    from examples.gpt import train

    train.check_split_args = lambda args, world_size: None
    return _gpt_jobs(rank, world, store, data, *runs)


def test_overwrite_with_a_refused_configuration_keeps_the_old_run(tmp_path):
    """World 2, tiny GPT jobs: a run leaves step 2; a second run with --overwrite and --sequence-parallel over 2
    devices with an odd --seq-len fails (exit 2, one line per rank) before removing anything, whether the job's
    flag check refuses it or, without that check, the first forward does: the old checkpoint is still there."""
    texts = tmp_path / "data" / "texts"
    texts.mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "tempest_gut.txt", texts)
    (texts / ".complete").touch()
    ck = tmp_path / "ck"
    common = ["--ckpt-dir", str(ck), "--summary", str(tmp_path / "s.json"), "--n-layer", "2"]
    bad = [*common, "--steps", "1", "--overwrite", "--sequence-parallel", "--seq-len", "15"]
    data = str(tmp_path / "data")
    first, refused = zip(*run_ranks(_gpt_jobs, 2, str(tmp_path / "a"), data, ({}, [*common, "--steps", "2"]),
                                    ({}, bad), timeout=120), strict=True)
    forward = [r[0] for r in run_ranks(_gpt_jobs_forward_checks, 2, str(tmp_path / "b"), data, ({}, bad), timeout=120)]
    assert [c for c, _ in first] == [0, 0] and "summary written to" in first[0][1]
    for rank, ((code, text), (code2, text2)) in enumerate(zip(refused, forward, strict=True)):
        assert code == 2 and f"error: [rank {rank}] ConfigError: --sequence-parallel over 2 devices per stage (2 " \
            "processes / --stages 1) needs --seq-len divisible by 2, got 15; use 14 or 16, or drop " \
            "--sequence-parallel\n" in text, text
        assert code2 == 2 and f"error: [rank {rank}] SplitError: sequence parallelism over 2 devices needs a " \
            "sequence length divisible by 2, got 15" in text2, text2
        assert "removed" not in text + text2
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002"]
