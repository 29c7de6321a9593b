"""``whale checkpoint inspect DIR`` and ``whale checkpoint export DIR OUT.safetensors``.

Both read a checkpoint without a process group (one process, no GPU): ``inspect`` prints the plan it was saved
under, its step, and every tensor's shape, dtype and size; ``export`` writes the model's whole tensors as a plain
state dict (safetensors: no pickle) that loads into the unannotated model with ``load_state_dict(strict=True)``
(a tied weight appears under each of its names, as that model's ``state_dict()`` lists it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from whale.plan.plan import Plan

_EPILOG = """\
examples:
  whale checkpoint inspect checkpoints/gpt              # the latest complete checkpoint under it
  whale checkpoint inspect checkpoints/gpt/step-00000200 --all
  whale checkpoint export checkpoints/gpt gpt.safetensors
then: model.load_state_dict(safetensors.torch.load_file("gpt.safetensors"), strict=True)
"""


def add_checkpoint(sub: argparse._SubParsersAction) -> None:
    """Register ``whale checkpoint`` with its ``inspect`` and ``export`` subcommands."""
    p = sub.add_parser("checkpoint", help="inspect or export a Whale checkpoint",
                       description="Inspect or export a Whale checkpoint (any plan).", epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="action", metavar="<action>", required=True)
    i = s.add_parser("inspect", help="print plan, step and tensor sizes")
    i.add_argument("dir", help="checkpoint root (latest complete one) or a step-N directory")
    i.add_argument("--all", action="store_true", help="list every tensor (default: the model's, optimizer summed)")
    i.add_argument("--no-verify", action="store_true", help="skip checking files against their SHA-256")
    e = s.add_parser("export", help="write the model's state dict as safetensors")
    e.add_argument("dir", help="checkpoint root (latest complete one) or a step-N directory")
    e.add_argument("out", help="output file, e.g. model.safetensors")
    p.set_defaults(func=_run, subparser=p)


def _run(ns: argparse.Namespace) -> int:
    # CLI start-up: whale.runtime loads only when a checkpoint command runs (`whale plan` must not load it)
    from whale.runtime.ckpt_store import CheckpointError

    try:
        if ns.action == "inspect":
            print(inspect(ns.dir, every=ns.all, verify=not ns.no_verify))
        else:
            n = export(ns.dir, ns.out)
            print(f"wrote {n} tensors to {ns.out}")
        return 0
    except CheckpointError as exc:
        print(f"whale checkpoint: error: {exc}", file=sys.stderr)
        return 1


def _bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def inspect(path: str, every: bool = False, verify: bool = True) -> str:
    """A readable summary of the checkpoint at ``path``: directory, step, world size, the plan, and the tensors.

    Raises:
        CheckpointError: no complete checkpoint, or (with ``verify``) a damaged file.
    """
    # CLI start-up: whale.runtime loads only when a checkpoint command runs (`whale plan` must not load it)
    from whale.runtime import ckpt_store as store
    from whale.runtime.fqn_state import MODEL, OPTIM

    ckpt = store.resolve(path)
    info = store.read_manifest(ckpt, verify)
    tensors = store.saved_tensors(ckpt)
    size = {k: torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for k, (s, d) in tensors.items()}
    model = sorted(k for k in tensors if k.startswith(MODEL))
    optim = sorted(k for k in tensors if k.startswith(OPTIM))
    lines = [f"checkpoint {ckpt}", f"step {info['step']}, saved by {info['world_size']} rank(s); files "
             f"{_bytes(sum(f['bytes'] for f in info['files'].values()))}" + (" (verified)" if verify else ""),
             "", "plan:", str(Plan.from_json(info["plan"])), "",
             f"model: {len(model)} tensors, {_bytes(sum(size[k] for k in model))}"]
    for k in model:
        shape, dtype = tensors[k]
        lines.append(f"  {k[len(MODEL):]:<40} {list(shape)!s:<16} {str(dtype).replace('torch.', ''):<9} "
                     f"{_bytes(size[k])}")
    lines.append(f"optimizer state: {len(optim)} tensors, {_bytes(sum(size[k] for k in optim))}")
    if every:
        lines += [f"  {k[len(OPTIM):]:<48} {list(tensors[k][0])}" for k in optim]
    return "\n".join(lines)


def export(path: str, out: str) -> int:
    """Write the model's whole tensors of the checkpoint at ``path`` to ``out`` (safetensors, original FQNs).
    Returns the number of tensors.

    Raises:
        CheckpointError: no complete checkpoint, or a damaged file.
    """
    from safetensors.torch import save_file  # lazy: an optional dependency, needed by export only

    # CLI start-up: whale.runtime loads only when a checkpoint command runs (`whale plan` must not load it)
    from whale.runtime import ckpt_store as store
    from whale.runtime.checkpoint import read_model_state

    state = {k: v.contiguous() for k, v in read_model_state(path).items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    step = store.read_manifest(store.resolve(path), False)["step"]
    save_file(state, out, metadata={"format": "pt", "step": str(step)})
    return len(state)
