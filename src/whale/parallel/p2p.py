"""Point-to-point transfer of stage boundary values (tensors and small Python values) between ranks.

Every transfer is non-blocking on the sender side (``dist.isend``), so two neighbouring stages that send to
each other at the same moment (a forward activation one way, a gradient the other) cannot deadlock.
A step's first forward transfer is one fixed-size header (the pickled description of the values: shapes,
dtypes, ``requires_grad``, and any non-tensor values inline) followed by one message per tensor; the step's
later micro-batches have the same description (the sender checks), so they send their tensors alone.
Gradients flow back without a header: both sides know their shapes.

From the second step on there is no header while the description stays the same: the receiver posts the
receives of the previous step's description (``guess``; both ends keep it) and the first tensor carries a flag
after its bytes, "same". When the description changed (another batch size, train then eval), the flag says
"changed" in placeholders of the previous shapes, which the receiver drops, and the header follows
(:func:`send_values` with ``previous``).

Receives are posted ahead (:class:`PendingRecv`): a stage posts the receive of micro-batch m+1's inputs as soon
as m's arrived (micro-batches of one step have equal shapes, so the previous header tells the sizes) and the
receive of m's output gradients right after sending m's outputs. A sender then finds its receiver ready and
its data goes out at once, instead of waiting for the sender's communication thread to be scheduled next to
its busy compute thread (milliseconds on a loaded core).
"""

from __future__ import annotations

import math
import pickle

import torch
import torch.distributed as dist

HEADER_BYTES = 4096
FLAG_BYTES = 8  # after the first tensor of a step's first transfer when a previous description was guessed


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


def _nbytes(m: tuple) -> int:
    """Bytes of a tensor described by ``m = ("t", shape, dtype, requires_grad)``."""
    return math.prod(m[1]) * m[2].itemsize


def _tensor_metas(meta: list | None) -> list:
    return [m for m in meta or [] if m[0] == "t"]


def _flagged(t: torch.Tensor | None, m: tuple, same: bool, device: torch.device) -> torch.Tensor:
    """One message: the bytes of ``t`` (described by ``m``; left uninitialised when ``None``) then
    ``FLAG_BYTES`` bytes of ``same``."""
    n = _nbytes(m)
    buf = torch.empty(n + FLAG_BYTES, dtype=torch.uint8, device=device)
    if t is not None:
        buf[:n].copy_(t.detach().reshape(-1).view(torch.uint8))
    buf[n:].fill_(int(same))
    return buf


def send_values(values: tuple, dst: int, device: torch.device, expect: list | None = None,
                previous: list | None = None, tag: int = 0) -> tuple[list, list]:
    """Start sending ``values`` to global rank ``dst``; returns ``(pending works, description)`` (keep the works
    until done).

    Without ``expect`` (a step's first micro-batch): with ``previous`` (the description of the previous step's
    first transfer to ``dst``, which the receiver passes to :class:`PendingRecv` as ``guess``) holding a tensor,
    the first tensor goes with a flag: "same description", and no header; or "changed" in a placeholder of
    ``previous``'s shapes, then the header. Otherwise the header goes first. With ``expect`` (the description
    sent for this step's first micro-batch) no header is sent: the receiver already posted the tensor
    receives from that description (:class:`PendingRecv` with ``expect``). ``tag``: the channel between the two
    ranks (an interleaved pipeline's virtual stages share rank pairs; messages of one channel stay in order).

    Raises:
        TransferError: a value that cannot be sent, a description over the header's size, or values whose
            description differs from ``expect`` (shapes changed between micro-batches of one step).
    """
    meta = _describe(values)
    tensors = [v.detach().contiguous() for v in values if isinstance(v, torch.Tensor)]
    works, guessed = [], _tensor_metas(previous)
    if expect is None and guessed and meta == previous:  # the receiver posted these receives: no header
        first = _flagged(tensors[0], guessed[0], True, device)
        works.append((dist.isend(first, dst, tag=tag), first))
        tensors = tensors[1:]
    elif expect is None:
        raw = pickle.dumps(meta)
        if len(raw) > HEADER_BYTES:
            raise TransferError(f"boundary description is {len(raw)} bytes, over the {HEADER_BYTES}-byte header; "
                                "pass fewer values across the stage boundary")
        if guessed:  # changed: the receiver's early receives take a "changed" flag and placeholders
            flag = _flagged(None, guessed[0], False, device)
            works.append((dist.isend(flag, dst, tag=tag), flag))
            works += _placeholders(guessed[1:], dst, device, tag)
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
        header[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        works.append((dist.isend(header, dst, tag=tag), header))
    elif meta != expect:
        raise TransferError(f"stage boundary values changed between micro-batches of one step ({expect} then "
                            f"{meta}); every micro-batch must pass values of the same shapes")
    works += [(dist.isend(t, dst, tag=tag), t) for t in tensors]
    return works, meta


def _placeholders(meta: list, dst: int, device: torch.device, tag: int = 0) -> list:
    """Send one uninitialised tensor per tensor of ``meta`` (its shape and dtype) to ``dst``."""
    works = []
    for m in _tensor_metas(meta):
        t = torch.empty(m[1], dtype=m[2], device=device)
        works.append((dist.isend(t, dst, tag=tag), t))
    return works


class PendingRecv:
    """A posted receive of one :func:`send_values` transfer from ``src``.

    With ``guess`` (the description of the previous step's first transfer from ``src``, holding a tensor) the
    receives of its tensors are posted at once, the first with the sender's flag: when it says "same", no
    header is awaited; when "changed", the rest are placeholders and the header follows. Without ``guess``
    or ``expect`` the header is received first and tells the tensors to receive. With ``expect`` (the
    description of this step's first micro-batch, which the sender checks its values against) the tensor
    receives are posted at once and no header is awaited: one header per step at most, not per micro-batch.
    """

    def __init__(self, src: int, device: torch.device, expect: list | None = None, guess: list | None = None,
                 tag: int = 0) -> None:
        self.src, self.device, self.expect, self.guess, self.tag = src, device, expect, guess, tag
        self.flag = self.flag_work = None
        guessed = _tensor_metas(guess) if expect is None else []
        if guessed:
            self.flag = torch.empty(_nbytes(guessed[0]) + FLAG_BYTES, dtype=torch.uint8, device=device)
            self.flag_work = dist.irecv(self.flag, src, tag=tag)
        early = expect if expect is not None else guessed[1:] if guessed else None
        self.tensors = _post(early, src, device, tag) if early is not None else None

    def _header(self) -> list:
        """Receive the header (posted now: the sender sent it) and post the tensors it describes."""
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        dist.irecv(header, self.src, tag=self.tag).wait()
        meta = pickle.loads(header.cpu().numpy().tobytes())
        self.tensors = _post(meta, self.src, self.device, self.tag)
        return meta

    def wait(self) -> tuple[tuple, list]:
        """The received values and their description. Float tensors that required grad on the sender come
        back as leaves with ``requires_grad=True``."""
        if self.expect is not None:
            meta = self.expect
        elif self.flag is None:
            meta = self._header()
        else:
            self.flag_work.wait()
            if bool(self.flag[-1]):  # the sender's description is the guess: its first tensor is here
                meta, m = self.guess, _tensor_metas(self.guess)[0]
                first = self.flag[: _nbytes(m)].view(m[2]).view(m[1]).clone()
                self.tensors = [(first, None)] + self.tensors  # done (a gloo receive is waited once)
            else:  # changed: drop the placeholders, then the header tells the real tensors
                for _, work in self.tensors:
                    work.wait()
                meta = self._header()
        out, tensors = [], iter(self.tensors)
        for m in meta:
            if m[0] == "v":
                out.append(m[1])
                continue
            t, work = next(tensors)
            if work is not None:
                work.wait()
            out.append(t.requires_grad_(m[3]))
        return tuple(out), meta


def _post(meta: list, src: int, device: torch.device, tag: int = 0) -> list:
    out = []
    for m in meta:
        if m[0] == "t":
            t = torch.empty(m[1], dtype=m[2], device=device)
            out.append((t, dist.irecv(t, src, tag=tag)))
    return out


def send_grads(inputs: tuple, dst: int, tag: int = 0) -> list:
    """Send the gradients of the received inputs that require grad (zeros where autograd left none)."""
    works = []
    for v in inputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            g = v.grad if v.grad is not None else torch.zeros_like(v)
            g = g.contiguous()
            works.append((dist.isend(g, dst, tag=tag), g))
    return works


def post_grads(outputs: tuple, src: int, tag: int = 0) -> list:
    """Post the receives of one gradient per output tensor that requires grad, in order; pass the result to
    :func:`wait_grads`."""
    posted = []
    for v in outputs:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            g = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # contiguous whatever the output's strides
            posted.append((g, dist.irecv(g, src, tag=tag)))
    return posted


def wait_grads(posted: list) -> list[torch.Tensor]:
    """Wait for gradients posted by :func:`post_grads`."""
    for _, work in posted:
        work.wait()
    return [g for g, _ in posted]

