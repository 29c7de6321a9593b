"""Fallback from a damaged latest checkpoint (issue 24), for benchmarks/reliability.py.

    PYTHONPATH=src:. python benchmarks/_rel_fallback.py          # prints the JSON of run()

One process saves two checkpoints of one run (tests/reshard_models.py's model, steps 1 and 2); then, for each
kind of damage to the newest one (truncated or bit-flipped data file, flipped DCP ``.metadata``, missing or
unparsable manifest, deleted shard file, truncated ``whale.pt``, emptied step directory, a ``latest`` that names
a missing directory), a fresh engine loads the directory. A case is ok when it loads the newest intact
checkpoint (step 1 for every damage of step 2; step 2 when only ``latest`` is wrong), every tensor is bitwise
the one saved, and the skipped one is named exactly once with its reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(data)


def _damage(d: Path, kind: str) -> None:
    """Damage checkpoint directory ``d`` (a ``step-N``) as ``kind`` says."""
    shard = d / "__0_0.distcp"
    if kind == "truncated_data":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "flipped_data":
        _flip(shard)
    elif kind == "flipped_metadata":
        _flip(d / ".metadata")
    elif kind == "missing_manifest":
        (d / "whale.json").unlink()
    elif kind == "unparsable_manifest":
        (d / "whale.json").write_text("{not json")
    elif kind == "deleted_shard":
        shard.unlink()
    elif kind == "truncated_meta":
        (d / "whale.pt").write_bytes((d / "whale.pt").read_bytes()[:16])
    elif kind == "emptied_dir":
        for f in d.iterdir():
            f.unlink()
    elif kind == "latest_missing":
        (d.parent / "latest").write_text("step-00000009\n")
    else:
        raise ValueError(kind)


KINDS = ("truncated_data", "flipped_data", "flipped_metadata", "missing_manifest", "unparsable_manifest",
         "deleted_shard", "truncated_meta", "emptied_dir", "latest_missing")


def _worker(tmp: Path) -> dict:
    """In this process (one rank): save steps 1 and 2, then try every kind; returns the counts and details."""
    import torch

    import whale as wh
    from tests.reshard_models import batches, engine

    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    e = engine("one", ctx)
    clean, saved = tmp / "clean", []
    for b in batches(2):
        e.step(b)
        e.save_checkpoint(os.fspath(clean))
        saved.append({k: v.clone() for k, v in e.module.state_dict().items()})
    details = {}
    for kind in KINDS:
        root = tmp / kind
        shutil.copytree(clean, root)
        _damage(root / "step-00000002", kind)
        fresh, err = engine("one", ctx, seed=3), io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                fresh.load_checkpoint(os.fspath(root))
        except Exception as exc:  # noqa: BLE001 - a failed case, counted
            details[kind] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        want = 2 if kind == "latest_missing" else 1
        same = all(torch.equal(v, saved[want - 1][k]) for k, v in fresh.module.state_dict().items())
        said = err.getvalue()
        named = said.count("skipped step-00000002") == 1 if want == 1 else said == ""
        details[kind] = {"ok": fresh.steps_done == want and same and named, "loaded_step": fresh.steps_done,
                         "message": said.strip()[:300]}
    ok = sum(d["ok"] for d in details.values())
    return {"corrupt_latest_fallbacks_ok": ok, "corrupt_latest_fallbacks_tried": len(details),
            "corrupt_latest_fallback_details": details}


def run(tmp: Path) -> dict:
    """Every damage kind in one fresh process under ``tmp`` (a few seconds): ``{"corrupt_latest_fallbacks_ok":
    n_ok, "corrupt_latest_fallbacks_tried": n, "corrupt_latest_fallback_details": {kind: ...}}``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker", os.fspath(tmp)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks/_rel_fallback.py worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(_worker(Path(sys.argv[2]))))
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as t:
            print(json.dumps(run(Path(t)), indent=1))
