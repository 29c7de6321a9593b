"""Checkpoint I/O that scales with the ranks: every rank writes a share of the bytes, hashes what it writes while
writing it, and on load hashes only the bytes it reads, as it reads them.

**Who writes what.** After the gathers of :mod:`whale.runtime.fqn_state` every rank holds its stage's tensors
whole (split shards all-gathered over their group, ZeRO slices broadcast over their buffer's group, replicas
identical by construction: the same reduced gradients and optimizer steps, buffers broadcast from lane 0 after
every step). Each rank hands all of them to DCP's ``save``; DCP's global plan keeps every key on one of the
ranks holding it, and :class:`SpreadPlanner` chooses that rank so that bytes spread evenly: largest tensors
first, each to the holder with the fewest bytes so far (longest-processing-time first: the busiest rank writes
at most 4/3 of the best split, plus rank 0's small ``.metadata`` and ``whale.pt``). DCP's own dedup gives each
key to the least-loaded holder in key order, which lets a large late tensor land on a full rank. A pipeline
without replicas cannot spread further than its stages: each stage's bytes are on its own ranks.

Why whole tensors, not each rank's own pieces as DCP chunks: DCP's chunk metadata is a box (offsets and sizes
per dim). Whale's pieces are not all boxes: a fused (q|k|v) shard is ``k`` separate blocks of the whole tensor,
and a ZeRO piece is a flat element range ``lo:hi`` of the flattened parameter (mid-row in general). Writing whole
tensors keeps the format and resharding (any plan loads any plan) unchanged; the gathers it needs run anyway.

**Hashing while writing.** :class:`Writer` is DCP's ``FileSystemWriter`` whose streams hash the bytes as they
pass through (``_HashingStream``); DCP writes each tensor as one ``torch.save`` between two ``tell()`` calls,
so each tensor's bytes get their own SHA-256 with no second read. Each rank's per-file entries (size, writer
rank, ``chunks``: ``[offset, length, sha256, key]``, together covering the file) are gathered to rank 0, which
writes them into the manifest (:func:`whale.runtime.ckpt_store.publish`) without reading any file; ``whale.pt``
is hashed from its in-memory bytes and ``.metadata`` as DCP writes it.

**Hashing while reading.** :class:`Reader` is DCP's ``FileSystemReader`` that reads each requested tensor's
byte range once into memory, checks its SHA-256 against the writer's, and parses it from memory; ``.metadata``
is checked before it is unpickled. A rank therefore hashes exactly the ranges it reads (a pipeline stage never
touches another stage's tensors) and a corrupted range is reported by the rank that reads it, naming the file,
the range, the tensor and the rank that wrote it. Every rank also checks every file's size (a stat).

Checkpoints of format ``whale-dcp-1`` (before this module: whole-file digests computed by rank 0 after the
save) still load; every rank then verifies every file first, as they were loaded then.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from whale.runtime import ckpt_store as store
from whale.runtime.ckpt_store import CheckpointError

FORMAT, OLD_FORMATS = "whale-dcp-2", ("whale-dcp-1",)
DCP_META = ".metadata"


def digest(data) -> str:
    """SHA-256 (hex) of a bytes-like object: the one hash of this module (writes and reads)."""
    return hashlib.sha256(data).hexdigest()


class _HashingStream:
    """A write-only file stream that hashes what passes through it: one segment per stretch between two
    ``tell()`` calls (DCP calls it before and after each item), ``segments[offset] = (length, sha256)``."""

    def __init__(self, raw) -> None:
        self.raw, self.pos, self.start, self.h, self.segments = raw, 0, 0, hashlib.sha256(), {}

    def write(self, b) -> int:
        """Write ``b`` to the file and into the current segment's hash; returns the bytes written."""
        n = self.raw.write(b)
        self.h.update(b)
        self.pos += memoryview(b).nbytes
        return n

    def tell(self) -> int:
        """The position (bytes written); DCP's item boundary, so the current segment closes here."""
        self.cut()
        return self.pos

    def cut(self) -> None:
        """Close the current segment (if it holds bytes) and start the next one here."""
        if self.pos > self.start:
            self.segments[self.start] = (self.pos - self.start, self.h.hexdigest())
            self.start, self.h = self.pos, hashlib.sha256()

    def flush(self) -> None:
        """Flush the file."""
        self.raw.flush()

    def fileno(self) -> int:
        """The file's descriptor (DCP fsyncs it)."""
        return self.raw.fileno()

    def close(self) -> None:
        """Close the last segment and the file."""
        self.cut()
        self.raw.close()


class _HashingFS(FileSystem):
    """DCP's local file system whose written files are hashed while written: ``written[name] = (bytes,
    segments)`` (renames followed, as DCP renames ``.metadata.tmp``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[int, dict]] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        """DCP's stream for ``path``: a :class:`_HashingStream` when writing (recorded in ``written``)."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as raw:
            stream = _HashingStream(raw)
            yield stream
            stream.cut()
            self.written[Path(path).name] = (stream.pos, stream.segments)

    def rename(self, path, new_path) -> None:
        """Rename the file, and its record in ``written``."""
        super().rename(path, new_path)
        if Path(path).name in self.written:
            self.written[Path(new_path).name] = self.written.pop(Path(path).name)


class Writer(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank, fsynced) that hashes every tensor while writing it;
    :meth:`entries` gives this rank's manifest entries."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(os.fspath(path), single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = _HashingFS()
        self.items: dict[str, dict[int, tuple[int, str]]] = defaultdict(dict)  # file -> offset -> (length, key)

    def write_data(self, plan, planner):
        """DCP's write, recording where each tensor went (``WriteResult.storage_data``)."""
        fut = super().write_data(plan, planner)
        for wr in fut.wait():
            s = wr.storage_data
            self.items[s.relative_path][s.offset] = (s.length, wr.index.fqn)
        return fut

    def entries(self, rank: int) -> dict[str, dict]:
        """``{file name: {"bytes", "rank", "chunks" | "sha256"}}`` of every file this rank wrote: data files
        per tensor (``[offset, length, sha256, key]``), others whole."""
        out = {}
        for name, (size, segments) in self.fs.written.items():
            if name not in self.items:
                out[name] = {"bytes": size, "rank": rank, "sha256": segments[0][1] if segments else digest(b"")}
                continue
            items, chunks = dict(self.items[name]), []
            for off, (length, sha) in sorted(segments.items()):
                item = items.get(off)
                hit = item is not None and item[0] == length
                chunks.append([off, length, sha, items.pop(off)[1] if hit else None])
            for off, (length, key) in sorted(items.items()):  # not on a tell() boundary (another DCP version):
                chunks.append([off, length, store._sha256(Path(self.path) / name, off, length), key])  # re-read
            out[name] = {"bytes": size, "rank": rank, "chunks": chunks}
        return out


# bytes a file holds per tensor beyond its data (torch.save's zip records: ~1.55 KB), and per key in the
# .metadata rank 0 writes (~0.28 KB): measured with torch 2.13; they matter for small tensors only
_ITEM_OVERHEAD, _META_PER_ITEM = 1600, 300


def spread(plans: list) -> list:
    """DCP's global dedup, balanced: every write item kept on exactly one of the plans (ranks) holding it,
    largest items first, each on the holder with the fewest bytes so far (ties: the lowest rank). Bytes: the
    tensor's plus :data:`_ITEM_OVERHEAD`; rank 0 starts with the ``.metadata`` it will write."""
    holders: dict = defaultdict(list)
    items: dict = {}
    for r, plan in enumerate(plans):
        for it in plan.items:
            holders[it.index].append(r)
            items[it.index] = it
    load, keep = [0] * len(plans), [set() for _ in plans]
    load[0] = _META_PER_ITEM * len(items)
    cost = {i: (it.tensor_storage_size() or 1) + _ITEM_OVERHEAD for i, it in items.items()}
    for index in sorted(holders, key=lambda i: -cost[i]):
        r = min(holders[index], key=lambda q: (load[q], q))
        load[r] += cost[index]
        keep[r].add(index)
    return [dataclasses.replace(p, items=[it for it in p.items if it.index in keep[r]]) for r, p in enumerate(plans)]


class SpreadPlanner(DefaultSavePlanner):
    """DCP's default save planner with :func:`spread` as its dedup."""

    def _dedup_save_plans(self, all_plans):
        return spread(all_plans)


def save_state(state: dict[str, torch.Tensor], tmp: Path, rank: int) -> dict[str, dict]:
    """Write ``state`` (this rank's whole tensors; the same key on several ranks must hold the same values)
    into ``tmp`` with DCP, spread over the ranks (collective over the default group when initialized).
    Returns this rank's manifest entries (:meth:`Writer.entries`)."""
    import torch.distributed.checkpoint as dcp

    writer = Writer(tmp)
    dcp.save(state, storage_writer=writer, planner=SpreadPlanner())
    return writer.entries(rank)


def write_meta(f: Path, obj: dict, rank: int = 0) -> dict:
    """``torch.save(obj)`` to ``f`` (fsynced), hashed from its in-memory bytes; returns its manifest entry."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    with open(f, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return {"bytes": data.nbytes, "rank": rank, "sha256": digest(data)}


def gather_entries(mine: dict[str, dict]) -> dict[str, dict]:
    """Every rank's manifest entries on rank 0 (``{}`` elsewhere; collective when a group of several ranks is
    initialized), in file-name order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(sorted(mine.items()))
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return dict(sorted((k, v) for part in parts or [] for k, v in part.items()))


def read_manifest(ckpt: Path) -> dict:
    """The manifest of ``ckpt``, checked for a training load: every file's size (a stat per file; this format's
    digests are checked as the bytes are read), or, for a ``whale-dcp-1`` checkpoint, every file's SHA-256.

    Raises:
        CheckpointError: a missing or truncated file, a corrupted one (``whale-dcp-1``), or a format this version
            does not read (named, with the formats it reads).
    """
    info = store.read_manifest(ckpt, verify=False)
    fmt = info.get("format")
    if fmt in OLD_FORMATS:
        return store.read_manifest(ckpt)
    if fmt != FORMAT:
        raise store.NotThisModelError(f"checkpoint {ckpt} has format {fmt!r}, which this Whale version does not "
                                      f"read (it reads {', '.join((FORMAT, *OLD_FORMATS))}); load it with the Whale "
                                      "version that wrote it")
    for name, want in info["files"].items():
        store.check_size(ckpt / name, want)
    return info


def hashed_by_writers(info: dict) -> bool:
    """Whether the checkpoint's digests are its writers' (checked while reading) rather than whole files'."""
    return info.get("format") == FORMAT


def read_whole(f: Path, want: dict) -> bytes:
    """All of ``f``, checked against its manifest entry ``want`` as read.

    Raises:
        CheckpointError: the file is missing, truncated or corrupted (named).
    """
    data = f.read_bytes() if f.is_file() else None
    if data is None or len(data) != want["bytes"]:
        store.check_size(f, want)
    if digest(data) != want["sha256"]:
        raise store.corrupted(f)
    return data


class Reader(FileSystemReader):
    """DCP's ``FileSystemReader`` that checks every byte range it reads against its writer's SHA-256, and
    ``.metadata`` before unpickling it (``files``: the manifest's entries)."""

    def __init__(self, ckpt: Path, files: dict[str, dict]) -> None:
        super().__init__(os.fspath(ckpt))
        self.ckpt, self.files, self._metadata = ckpt, files, None
        self.chunks = {(name, c[0]): (c, e.get("rank")) for name, e in files.items() for c in e.get("chunks", ())}

    def read_metadata(self, *args, **kwargs):
        """DCP's index of the tensors, unpickled once its bytes matched the manifest (per-rank ones: none)."""
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("a Whale checkpoint has one global .metadata")
        if self._metadata is None:
            self._metadata = pickle.loads(read_whole(self.ckpt / DCP_META, self.files[DCP_META]))
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file, sinfo):
        f = self.ckpt / sinfo.relative_path
        found = self.chunks.get((sinfo.relative_path, sinfo.offset))
        if found is None or found[0][1] != sinfo.length:
            raise CheckpointError(f"checkpoint file {f}: bytes {sinfo.offset}-{sinfo.offset + sinfo.length} are "
                                  "not listed in the manifest; the checkpoint is damaged: load an earlier step "
                                  "directory")
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        verify_chunk(f, found[0], found[1], data)
        return io.BytesIO(data)


def verify_chunk(f: Path, chunk: list, rank: int | None, data: bytes) -> None:
    """``data`` (read from ``f``) is manifest chunk ``chunk`` as rank ``rank`` wrote it.

    Raises:
        CheckpointError: :func:`whale.runtime.ckpt_store.corrupted` naming the file, range, tensor and writer.
    """
    if len(data) != chunk[1] or digest(data) != chunk[2]:
        raise store.corrupted(f, chunk, rank)


def _reader(ckpt: Path, info: dict):
    return Reader(ckpt, info["files"]) if hashed_by_writers(info) else FileSystemReader(os.fspath(ckpt))


def saved_tensors(ckpt: Path, info: dict) -> dict[str, tuple[tuple[int, ...], object]]:
    """Every tensor of the checkpoint: key -> ``(shape, dtype)``, from DCP's ``.metadata`` (checked against the
    manifest first; ``info`` from :func:`read_manifest`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = _reader(ckpt, info).read_metadata()
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def read_tensors(ckpt: Path, request: dict, info: dict) -> None:
    """Fill ``request`` (key -> preallocated tensor of the saved shape) from the checkpoint, this process alone
    (no collective), checking each byte range read against its writer's digest.

    Raises:
        CheckpointError: a corrupted or unlisted range (named), unwrapped from DCP's ``CheckpointException``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(request, storage_reader=_reader(ckpt, info), no_dist=True)
    except CheckpointException as exc:
        first = next((e for e, _ in exc.failures.values() if isinstance(e, CheckpointError)), None)
        if first is None:
            raise
        raise first from None
