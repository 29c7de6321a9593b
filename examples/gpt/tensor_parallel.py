"""Tensor parallelism of the example GPT's blocks: the split rule for :class:`examples.gpt.model.Block`.

A block under ``wh.split()`` is cut Megatron-style (Shoeybi et al. 2019) by whole attention heads and MLP
features: the fused q|k|v ``c_attn`` column-parallel with q, k and v cut alike (``parts=3``), the attention's
``c_proj`` row-parallel over the same heads, the MLP's ``c_fc`` column- and ``c_proj`` row-parallel. The
shard is a shallow copy of the block with its layers swapped, so :class:`~examples.gpt.model.Block`'s own
forward runs unchanged (``CausalSelfAttention`` reads its head count from ``n_head``, set to the local one).

With ``Config(sequence_parallel=True)`` the rule builds the sequence-parallel shard
(:mod:`whale.parallel.seqpar`): LayerNorms, dropouts and residual adds on ``[B, s/n, C]`` sequence shards,
all-gather before ``c_attn`` / ``c_fc`` and reduce-scatter after the two ``c_proj``. Without it, the plain
tensor-parallel shard: the block's input replicated on the group, one all-reduce after each ``c_proj`` in
forward and one before each column-parallel Linear in backward.

Dropout matches one process (the residual and MLP dropouts draw the whole tensor's mask from the region's
group stream, :mod:`whale.runtime.rng`). Attention-probability dropout inside the attention kernel cannot (each
rank holds other heads, and the kernel draws internally), so a block with ``attn.dropout > 0`` is refused.
Importing this module registers the rule (``examples.gpt.model`` does it for ``GPT(split_blocks=True)``).
"""

from __future__ import annotations

import copy

from torch import nn

import whale as wh
from examples.gpt.model import MLP, Block, CausalSelfAttention
from whale.parallel.seqpar import SeqColumnParallelLinear, SeqDropout, SeqLayerNorm, SeqRowParallelLinear
from whale.parallel.split import RowParallelLinear, SplitError, group_rank, group_size, shard_sizes


def _with(module: nn.Module, **children: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._modules.update(children)
    return clone


def _dropout(drop: nn.Dropout, group, sp: bool) -> nn.Module:
    return SeqDropout(drop.p, group) if sp else drop


def _attention(attn: CausalSelfAttention, group, heads: list[int], sp: bool) -> CausalSelfAttention:
    """``attn`` cut by whole heads (``heads[r]`` on rank r)."""
    head_dim = attn.c_proj.in_features // attn.n_head
    feats = [h * head_dim for h in heads]
    row = SeqRowParallelLinear if sp else RowParallelLinear
    clone = _with(attn, c_attn=SeqColumnParallelLinear(attn.c_attn, group, feats, parts=3, sequence_parallel=sp),
                  c_proj=row(attn.c_proj, group, feats), resid_drop=_dropout(attn.resid_drop, group, sp))
    clone.n_head = heads[group_rank(group)]
    return clone


def _mlp(mlp: MLP, group, weights, sp: bool) -> MLP:
    feats = shard_sizes(mlp.c_fc.out_features, group_size(group), weights)
    row = SeqRowParallelLinear if sp else RowParallelLinear
    return _with(mlp, c_fc=SeqColumnParallelLinear(mlp.c_fc, group, feats, sequence_parallel=sp),
                 c_proj=row(mlp.c_proj, group, feats), drop=_dropout(mlp.drop, group, sp))


def shard_block(block: Block, group, sizes=None, **ctx) -> Block:
    """This rank's shard of a GPT :class:`~examples.gpt.model.Block` (see the module docstring).

    Shapes: ``[B, s, C]`` (replicated) → ``[B, s, C]``; with ``ctx["sequence_parallel"]`` ``[B, s/n, C]`` →
    ``[B, s/n, C]`` (this rank's sequence shard). Heads and MLP features follow ``ctx["weights"]`` (whole
    heads, at least one per rank); ``sizes`` is not taken (the block has two cut dims).

    Raises:
        SplitError: explicit ``sizes``, an MoE block, attention dropout, or fewer heads than ranks.
    """
    n, weights, sp = group_size(group), ctx.get("weights"), bool(ctx.get("sequence_parallel"))
    if sizes is not None:
        raise SplitError("the GPT block's split rule cuts heads and MLP features by ctx weights; explicit sizes "
                         f"{sizes} are not taken (give shard weights instead)")
    if not isinstance(block.mlp, MLP):
        raise SplitError(f"the GPT block's split rule shards a dense MLP, got {type(block.mlp).__name__}; build MoE "
                         "blocks without wh.split around the block (the MoE layer is split on its own)")
    if block.attn.dropout > 0:
        raise SplitError(f"a split GPT block with attention dropout {block.attn.dropout} cannot match one process "
                         "(each rank holds other heads and the attention kernel draws its own mask); set "
                         "GPTConfig.attn_dropout=0 (the residual and MLP dropouts stay)")
    if block.attn.n_head < n:
        raise SplitError(f"split over {n} devices cannot cut a GPT block of {block.attn.n_head} heads into whole "
                         f"heads; use at most {block.attn.n_head} devices or more heads")
    heads = shard_sizes(block.attn.n_head, n, weights)
    clone = _with(block, ln_1=SeqLayerNorm(block.ln_1, group, sp), ln_2=SeqLayerNorm(block.ln_2, group, sp),
                  attn=_attention(block.attn, group, heads, sp), mlp=_mlp(block.mlp, group, weights, sp))
    clone.sequence_parallel = sp
    return clone


def block_split_refusal(block: Block, n: int) -> str | None:
    """Why :func:`shard_block` cannot shard ``block`` over ``n`` devices (``None``: it can): checked at plan time,
    so neither a plan nor ``Config(auto=True)``'s search holds a split the rule would refuse at run time."""
    if not isinstance(block.mlp, MLP):
        return "an MoE block is not split whole (build it without wh.split; the MoE layer is split on its own)"
    if block.attn.dropout > 0:
        return (f"attention dropout {block.attn.dropout} cannot match one process under split; set "
                "GPTConfig.attn_dropout=0")
    return None


wh.register_split_rule(Block, shard_block, dim_size=lambda block: block.attn.n_head, check=block_split_refusal)


def add_split_args(p) -> None:
    """``--tensor-parallel`` and ``--sequence-parallel`` on the argparse parser ``p``."""
    p.add_argument("--tensor-parallel", action="store_true",
                   help="build every block under wh.split(): tensor parallelism over each stage's devices (all of "
                        "them with --stages 1), attention dropout off")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="--tensor-parallel plus sequence parallelism (Config.sequence_parallel): LayerNorm, dropout "
                        "and the residual stream on sequence shards; --seq-len must be a multiple of the split degree")


def check_split_args(args, world_size: int) -> str | None:
    """The one-line error of ``--sequence-parallel`` with a ``--seq-len`` its split degree does not divide (the
    blocks are split over each stage's ``world_size // --stages`` devices, and every sequence is cut into that many
    equal shards), or ``None``. Checked before the job trains or touches ``--ckpt-dir``: the shards are cut in the
    first forward, too late to refuse the flags before ``--overwrite`` has removed the old run's checkpoints."""
    n = max(1, world_size // args.stages)
    if not args.sequence_parallel or args.seq_len % n == 0:
        return None
    lo = max(n, args.seq_len - args.seq_len % n)
    return (f"--sequence-parallel over {n} devices per stage ({world_size} processes / --stages {args.stages}) "
            f"needs --seq-len divisible by {n}, got {args.seq_len}; use {lo} or {lo + n}, or drop --sequence-parallel")


def split_blocks(args) -> bool:
    """Whether the flags put the blocks under ``wh.split()``."""
    return bool(args.tensor_parallel or args.sequence_parallel)
