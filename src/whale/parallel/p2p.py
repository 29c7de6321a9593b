"""Point-to-point transfer of stage boundary values (tensors and small Python values) between ranks.

Every transfer is non-blocking on the sender side (``dist.isend``), so two neighbouring stages that send to
each other at the same moment (a forward activation one way, a gradient the other) cannot deadlock.
A forward transfer is one fixed-size header (the pickled description of the values: shapes, dtypes,
``requires_grad``, and any non-tensor values inline) followed by one message per tensor. Gradients flow back
without a header: both sides know their shapes.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

HEADER_BYTES = 4096


class TransferError(RuntimeError):
    """A boundary value that cannot be sent between stages."""


def _describe(values: tuple) -> list:
    meta = []
    for v in values:
        if isinstance(v, torch.Tensor):
            meta.append(("t", tuple(v.shape), v.dtype, bool(v.requires_grad)))
        elif v is None or isinstance(v, int | float | bool | str | tuple | torch.Size | torch.dtype):
            meta.append(("v", v))
        else:
            raise TransferError(
                f"stage boundary value of type {type(v).__name__} cannot be sent between pipeline stages; "
                "pass tensors or plain Python scalars/tuples across TaskGraph boundaries"
            )
    return meta


def send_values(values: tuple, dst: int, device: torch.device) -> list:
    """Start sending ``values`` to global rank ``dst``; returns the pending works (keep them until done)."""
    raw = pickle.dumps(_describe(values))
    if len(raw) > HEADER_BYTES:
        raise TransferError(f"boundary description is {len(raw)} bytes, over the {HEADER_BYTES}-byte header; "
                            "pass fewer values across the stage boundary")
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
    header[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    works = [(dist.isend(header, dst), header)]
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous()
            works.append((dist.isend(t, dst), t))
    return works


def recv_values(src: int, device: torch.device) -> tuple:
    """Receive values sent by :func:`send_values` from ``src``. Float tensors that required grad on the
    sender come back as leaves with ``requires_grad=True``."""
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
    dist.recv(header, src)
    meta = pickle.loads(header.cpu().numpy().tobytes())
    out = []
    for m in meta:
        if m[0] == "v":
            out.append(m[1])
            continue
        _, shape, dtype, requires_grad = m
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t.requires_grad_(requires_grad))
    return tuple(out)


def send_grads(inputs: tuple, dst: int) -> list:
    """Send the gradients of the received inputs that require grad (zeros where autograd left none)."""
    works = []
    for v in inputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            g = v.grad if v.grad is not None else torch.zeros_like(v)
            g = g.contiguous()
            works.append((dist.isend(g, dst), g))
    return works


def recv_grads(outputs: tuple, src: int) -> list[torch.Tensor]:
    """Receive one gradient per output tensor that requires grad, in order."""
    grads = []
    for v in outputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            g = torch.empty_like(v)
            dist.recv(g, src)
            grads.append(g)
    return grads
