"""Point-to-point transfer of stage boundary values (tensors and small Python values) between ranks.

Every transfer is non-blocking on the sender side (``dist.isend``), so two neighbouring stages that send to
each other at the same moment (a forward activation one way, a gradient the other) cannot deadlock.
A step's first forward transfer is one fixed-size header (the pickled description of the values: shapes,
dtypes, ``requires_grad``, and any non-tensor values inline) followed by one message per tensor; the step's
later micro-batches have the same description (the sender checks), so they send their tensors alone.
Gradients flow back without a header: both sides know their shapes.

The header does not delay the step's first tensors: the receiver posts their receives together with the
header's, from the previous step's description (``guess``; both ends keep it). When the description changed
(another batch size, train then eval), the sender first sends placeholders of the previous description's
shapes, which the receiver's early receives take and drop, then the real tensors (:func:`send_values` with
``previous``).

Receives are posted ahead (:class:`PendingRecv`): a stage posts the receive of micro-batch m+1's inputs as soon
as m's arrived (micro-batches of one step have equal shapes, so the previous header tells the sizes) and the
receive of m's output gradients right after sending m's outputs. A sender then finds its receiver ready and
its data goes out at once, instead of waiting for the sender's communication thread to be scheduled next to
its busy compute thread (milliseconds on a loaded core).
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


def send_values(values: tuple, dst: int, device: torch.device, expect: list | None = None,
                previous: list | None = None) -> tuple[list, list]:
    """Start sending ``values`` to global rank ``dst``; returns ``(pending works, description)`` (keep the works
    until done).

    Without ``expect`` (a step's first micro-batch) a header with the description goes first; ``previous``
    (the description of the previous step's first transfer to ``dst``, which the receiver passes to
    :class:`PendingRecv` as ``guess``) adds placeholders of its shapes when the description changed. With
    ``expect`` (the description sent for this step's first micro-batch) no header is sent: the receiver
    already posted the tensor receives from that description (:class:`PendingRecv` with ``expect``).

    Raises:
        TransferError: a value that cannot be sent, a description over the header's size, or values whose
            description differs from ``expect`` (shapes changed between micro-batches of one step).
    """
    meta = _describe(values)
    works = []
    if expect is None:
        raw = pickle.dumps(meta)
        if len(raw) > HEADER_BYTES:
            raise TransferError(f"boundary description is {len(raw)} bytes, over the {HEADER_BYTES}-byte header; "
                                "pass fewer values across the stage boundary")
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
        header[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        works.append((dist.isend(header, dst), header))
        if previous is not None and meta != previous:  # the receiver's early receives take these and drop them
            works += _placeholders(previous, dst, device)
    elif meta != expect:
        raise TransferError(f"stage boundary values changed between micro-batches of one step ({expect} then "
                            f"{meta}); every micro-batch must pass values of the same shapes")
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous()
            works.append((dist.isend(t, dst), t))
    return works, meta


def _placeholders(meta: list, dst: int, device: torch.device) -> list:
    """Send one uninitialised tensor per tensor of ``meta`` (its shape and dtype) to ``dst``."""
    works = []
    for m in meta:
        if m[0] == "t":
            t = torch.empty(m[1], dtype=m[2], device=device)
            works.append((dist.isend(t, dst), t))
    return works


class PendingRecv:
    """A posted receive of one :func:`send_values` transfer from ``src``.

    Without ``expect`` the header is received first and tells the tensors to receive; with ``guess`` (the
    description of the previous step's first transfer from ``src``) the tensor receives are posted at once
    beside the header's, and re-posted only when the header differs. With ``expect`` (the description of this
    step's first micro-batch, which the sender checks its values against) the tensor receives are posted at
    once and no header is awaited: one header per step, not per micro-batch.
    """

    def __init__(self, src: int, device: torch.device, expect: list | None = None, guess: list | None = None) -> None:
        self.src, self.device, self.expect, self.guess = src, device, expect, guess
        self.header = self.work = None
        if expect is None:
            self.header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
            self.work = dist.irecv(self.header, src)
        early = expect if expect is not None else guess
        self.tensors = _post(early, src, device) if early is not None else None

    def wait(self) -> tuple[tuple, list]:
        """The received values and their description. Float tensors that required grad on the sender come
        back as leaves with ``requires_grad=True``."""
        if self.work is not None:
            self.work.wait()
            meta = pickle.loads(self.header.cpu().numpy().tobytes())
            if meta != self.guess:  # changed (or no guess): drop the placeholders, receive the real tensors
                for _, work in self.tensors or []:
                    work.wait()
                self.tensors = _post(meta, self.src, self.device)
        else:
            meta = self.expect
        out, tensors = [], iter(self.tensors)
        for m in meta:
            if m[0] == "v":
                out.append(m[1])
                continue
            t, work = next(tensors)
            work.wait()
            out.append(t.requires_grad_(m[3]))
        return tuple(out), meta


def _post(meta: list, src: int, device: torch.device) -> list:
    out = []
    for m in meta:
        if m[0] == "t":
            t = torch.empty(m[1], dtype=m[2], device=device)
            out.append((t, dist.irecv(t, src)))
    return out


def send_grads(inputs: tuple, dst: int) -> list:
    """Send the gradients of the received inputs that require grad (zeros where autograd left none)."""
    works = []
    for v in inputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            g = v.grad if v.grad is not None else torch.zeros_like(v)
            g = g.contiguous()
            works.append((dist.isend(g, dst), g))
    return works


def post_grads(outputs: tuple, src: int) -> list:
    """Post the receives of one gradient per output tensor that requires grad, in order; pass the result to
    :func:`wait_grads`."""
    posted = []
    for v in outputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            g = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # contiguous whatever the output's strides
            posted.append((g, dist.irecv(g, src)))
    return posted


def wait_grads(posted: list) -> list[torch.Tensor]:
    """Wait for gradients posted by :func:`post_grads`."""
    for _, work in posted:
        work.wait()
    return [g for g, _ in posted]

