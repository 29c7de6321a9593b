"""The batch bridge between pipeline stages of different widths: the rows of a micro-batch re-split from the n
lanes of one stage to the m lanes of the next.

The plan says which rows each pair of neighbouring lanes shares (:meth:`whale.plan.layout.PlanLayout.
boundary_peers`); here a sender cuts its boundary values into those rows, one message per receiving lane
(:func:`slice_for`), and a receiver joins the pieces of all its senders back into its own rows in order
(:func:`join`). Gradients go the reverse way: autograd sums the gradients of a sender's pieces into its output,
and the gradient of each received piece goes back to the lane that sent it. In a regular plan (every stage of
one width) each lane has one peer holding all its rows, and values pass whole, as they always did.
"""

from __future__ import annotations

import torch

from whale.parallel.p2p import TransferError
from whale.plan.layout import Peer


def slice_for(values: tuple, peer: Peer, rows: int, bridged: bool) -> tuple:
    """``values`` cut to the rows ``peer`` shares with this lane (dim 0); non-tensor values pass whole.

    Args:
        values: the stage's boundary values (tensors with this lane's ``rows`` samples in dim 0).
        peer: the receiving lane and its rows (offsets into this lane's rows).
        rows: this lane's rows in the micro-batch.
        bridged: whether the stages differ in width (values are then checked to be per-sample); when not,
            values pass whole.

    Raises:
        TransferError: across a bridge, a tensor whose dim 0 is not this lane's rows (not per-sample).
    """
    if not bridged:
        return values
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if v.dim() == 0 or v.size(0) != rows:
                raise TransferError(
                    f"boundary value {i} has shape {tuple(v.shape)}, but between stages of different widths every "
                    f"tensor crossing the boundary must hold one row per sample in dim 0 (this lane has {rows} "
                    "rows): its rows are re-split among the next stage's lanes. Pass per-sample tensors across "
                    "the boundary (recompute other values in the stage that uses them), or give the stages the "
                    "same device_count")
            v = v[peer.lo:peer.hi]
        out.append(v)
    return tuple(out)


def join(pieces: list[tuple]) -> tuple:
    """One tuple of values from the pieces received from each sending lane, in row order: tensors are
    concatenated along dim 0 (under autograd, so each piece gets its gradient), other values come from the
    first piece. One piece is returned as it is."""
    if len(pieces) == 1:
        return pieces[0]
    return tuple(torch.cat([p[i] for p in pieces]) if isinstance(v, torch.Tensor) else v
                 for i, v in enumerate(pieces[0]))
