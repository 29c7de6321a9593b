"""Expert parallelism: an MoE layer (:class:`whale.MoE`) under ``split`` keeps whole experts on each device of
the split group and sends tokens to them by all-to-all (GShard, Lepikhin et al. 2020 §2.2; Switch Transformer,
Fedus et al. 2021).

:class:`ExpertParallelMoE` is this rank's shard. The stacked expert tensors (``w1 [E, d, f]``, ``b1``, ``w2``,
``b2``) are cut along dim 0 into whole experts, ``counts[r]`` on group rank r (uneven: the plan's shard weights,
by device speed, :func:`whale.planner.experts.expert_counts`); the router is whole on every rank. The layer
**keeps its rows** (``keeps_rows = True``: :class:`whale.parallel.bridge.SplitRegion` puts no row bridges around
it): each rank routes the rows its data-parallel lane holds, as the one-process layer would (drops are decided
per sample, so locally, see :mod:`whale.moe`), then per forward:

1. exchange per-expert token counts: ``all_to_all_single`` of E int64 (``comm_bytes["alltoall_counts"]``);
2. dispatch: ``all_to_all_single`` of the kept (token, choice) rows ``[M, d]``, sorted by expert, uneven split
   sizes (gloo on torch 2.13 supports uneven splits, zero-size ones included: no padding needed);
3. every local expert runs on the rows it received (grouped by expert, then source rank, then token);
4. combine: the reverse ``all_to_all_single`` brings each row's output home, where it is gate-weighted and
   summed into its token.

Backward runs the same two all-to-alls in reverse (:class:`_AllToAll`). Bytes: ``comm_bytes["alltoall"]``
counts what an all-to-all moves over the network, the rows this rank sends to OTHER ranks (its own chunk stays
local): per forward ``2 x sent x d x itemsize`` (dispatch + combine) and the same again in backward, where sent
= kept (token, choice) pairs of this rank's tokens whose expert lives on another rank. Under uniform routing that
is ``(n-1)/n`` of the dispatched bytes, as :func:`whale.planner.steptime.cost.all_to_all_time` models it.

Gradients: the router is data parallel (its gradient is summed over every lane of the stage, like a replicate
parameter: its module sets ``data_parallel = True``, so :class:`whale.parallel.regions.SplitRuntime` leaves it
out of the sharded set); each expert's gradient already holds every group rank's tokens through the all-to-all
backward, and is summed only over the ranks holding the same experts in other replicas (nested data
parallelism), never over the split group.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from whale.moe import MoE, combine, dispatch_order, expert_ffn, route_tokens
from whale.parallel.split_ops import comm_bytes, group_rank, group_size, offsets, resolve_sizes
from whale.parallel.split_state import local_param, replicated_param
from whale.splitrules import _register_builtin

__all__ = ["ExpertParallelMoE", "all_to_all"]


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int],
               kind: str = "alltoall") -> torch.Tensor:
    """``dist.all_to_all_single`` along dim 0: rows ``[offsets(in_splits)[r], +in_splits[r])`` of ``x`` go to
    group rank r; the result holds ``out_splits[r]`` rows from rank r, in rank order. Counts the bytes sent to
    other ranks in ``comm_bytes[kind]`` (module docstring). Identity for a group of one rank."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    me = group_rank(group)
    comm_bytes[kind] += (x.shape[0] - in_splits[me]) * (x[:1].numel() * x.element_size())
    dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """:func:`all_to_all` with its adjoint (the reverse all-to-all of the gradients) as backward."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        """Rows of ``x`` to their ranks (see :func:`all_to_all`)."""
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        """Each row's gradient back to the rank it came from."""
        return all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _Router(nn.Module):
    """The router's weight ``[E, d]``, whole on every rank and data parallel (gradient summed over lanes)."""

    data_parallel = True

    def __init__(self, weight: torch.Tensor, group) -> None:
        super().__init__()
        self.weight = replicated_param(weight, group, weight.shape[1] ** -0.5)

    def shard_layout(self) -> dict[str, int | None]:
        """Whole on every rank of the group."""
        return {"weight": None}


class ExpertParallelMoE(nn.Module):
    """This rank's shard of an :class:`whale.MoE` under split (module docstring): ``[b, ..., d] -> [b, ..., d]``
    for this rank's own rows.

    Args:
        moe: the full layer (its weights are copied; experts ``[start, start + count)`` kept here).
        group: the split process group (``None``: default group).
        sizes: experts per group rank (each >= 1, adding up to E), or ``None`` to derive them from ``weights``.
        weights: relative speed per group rank (hardware-aware counts); ``None``: as equal as whole experts allow.

    Attributes:
        sizes: experts per group rank; ``shard_start`` / ``shard_size``: this rank's experts.
        aux_loss: as :attr:`whale.MoE.aux_loss`, for this rank's rows (also written to ``moe.aux_loss``, so that
            :func:`whale.moe_aux_loss` over the user's model finds it).

    Raises:
        ValueError: fewer experts than ranks, or ``sizes`` that are not one count >= 1 per rank adding up to E.
    """

    is_moe = True
    keeps_rows = True  # SplitRegion passes this rank's rows through: tokens travel by all-to-all instead
    LAYOUT = {"w1": 0, "b1": 0, "w2": 0, "b2": 0}

    def __init__(self, moe: MoE, group=None, sizes: list[int] | None = None,
                 weights: list[float] | None = None) -> None:
        super().__init__()
        for name in ("d_model", "d_ff", "num_experts", "top_k", "capacity_factor", "activation", "aux_loss_coef",
                     "z_loss_coef"):
            setattr(self, name, getattr(moe, name))
        self.group = group
        self.sizes = resolve_sizes(moe.num_experts, group, sizes, weights)
        self.rank_in_group = group_rank(group)
        self.shard_start, self.shard_size = offsets(self.sizes)[self.rank_in_group], self.sizes[self.rank_in_group]
        self.router = _Router(moe.router.weight, group)
        for name, fan_in in (("w1", self.d_model), ("b1", self.d_model), ("w2", self.d_ff), ("b2", self.d_ff)):
            full = getattr(moe, name)
            setattr(self, name, None if full is None else
                    local_param(full, 0, self.shard_start, self.shard_size, fan_in ** -0.5))
        self._origin = weakref.ref(moe)
        self.aux_loss: torch.Tensor | None = None
        self.last_routing = None

    def shard_layout(self) -> dict[str, int | None]:
        """Experts sharded along dim 0 (the router is its own module, whole on every rank)."""
        return {name: dim for name, dim in self.LAYOUT.items() if getattr(self, name, None) is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[b, ..., d]`` -> their outputs ``[b, ..., d]`` (collective over the group)."""
        tokens, routing = route_tokens(self, x)
        origin = self._origin()
        if origin is not None:
            origin.aux_loss = self.aux_loss
        token, expert, gate = dispatch_order(routing)
        send, recv, local_counts, order = self._exchange_counts(expert)
        received = _AllToAll.apply(tokens[token], self.group, recv, send)
        y = expert_ffn(received[order], local_counts, self.w1, self.b1, self.w2, self.b2, self.activation)
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        out = _AllToAll.apply(y[back], self.group, send, recv)
        return combine(out, token, gate, tokens.shape[0], x)

    def _exchange_counts(self, expert: torch.Tensor) -> tuple[list[int], list[int], list[int], torch.Tensor]:
        """Token counts per expert to the ranks holding the experts: returns rows this rank sends to each rank,
        rows it receives from each rank, rows per local expert, and the permutation grouping the received rows
        by local expert (stable: then by source rank, then the source's order)."""
        n = len(self.sizes)
        counts = torch.bincount(expert, minlength=self.num_experts)  # [E], sorted-by-expert order
        got = all_to_all(counts, self.group, [self.shard_size] * n, self.sizes, kind="alltoall_counts")
        got = got.reshape(n, self.shard_size)  # [source rank, local expert]
        starts = offsets(self.sizes) + [self.num_experts]
        cum = [0] + counts.cumsum(0).tolist()
        send = [cum[starts[r + 1]] - cum[starts[r]] for r in range(n)]
        local_expert = torch.repeat_interleave(torch.arange(self.shard_size, device=got.device).repeat(n),
                                              got.reshape(-1))
        order = torch.sort(local_expert, stable=True).indices
        return send, got.sum(1).tolist(), got.sum(0).tolist(), order

    def extra_repr(self) -> str:
        """Shard layout for ``print(module)``."""
        return (f"num_experts={self.num_experts} (local {self.shard_start}:{self.shard_start + self.shard_size} "
                f"of sizes {self.sizes}), d_model={self.d_model}, d_ff={self.d_ff}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}")


def _moe_rule(module, group, sizes, **ctx):
    return ExpertParallelMoE(module, group, sizes, weights=ctx.get("weights"))


def _already_sharded(module, group, sizes, **ctx):
    return module


_register_builtin(MoE, _moe_rule)
_register_builtin(ExpertParallelMoE, _already_sharded)



def expected_alltoall_bytes(routings: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int], d_model: int,
                            itemsize: int = 4) -> list[int]:
    """Per group rank, the bytes :func:`all_to_all` sends to other ranks in one forward + backward of one layer,
    from the routing alone: ``2 x (P_out + P_in) x d_model x itemsize``, where P_out = kept (token, choice) pairs
    of the rank's tokens whose expert lives on another rank and P_in = other ranks' kept pairs whose expert lives
    on this one (forward: dispatch sends P_out rows, combine returns P_in; backward the reverse, the same again).

    Args:
        routings: per group rank, ``(experts, keep)`` ``[S, T, k]`` of its :class:`whale.moe.Routing`.
        sizes: experts per group rank.
    """
    owner_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    pairs = torch.zeros(len(sizes), len(sizes), dtype=torch.int64)  # [source, destination]
    for src, (experts, keep) in enumerate(routings):
        pairs[src] += torch.bincount(owner_of[experts[keep]], minlength=len(sizes))
    off = pairs - torch.diag(pairs.diagonal())
    return [int(2 * (off[r].sum() + off[:, r].sum())) * d_model * itemsize for r in range(len(sizes))]
