"""split: sharded operators, collectives and the sharded loss against a single-process reference.

Every distributed check runs at world 2 and 4 with equal and uneven shard sizes of an 8-wide dim. The reference
is a ``deepcopy`` of the same full module run by plain PyTorch on the same (replicated) data; compared: forward
outputs (or this rank's slice of them), losses, input gradients, each local parameter shard's gradient against
the matching slice of the reference gradient, and the parameters after 3 AdamW steps (lr 1e-3), fp32 with
rtol 1e-5 / atol 1e-6. All checks of one configuration share one ``run_ranks`` call (each call spawns processes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_ranks
from whale.parallel.split import (
    ColumnParallelLinear,
    RowParallelLinear,
    SplitError,
    VocabParallelEmbedding,
    check_sizes,
    copy_to_group,
    gather_from_group,
    offsets,
    reduce_from_group,
    register_split_rule,
    scatter_to_group,
    shard_module,
    shard_sizes,
    sharded_accuracy,
    sharded_argmax,
    sharded_cross_entropy,
)

RTOL, ATOL = 1e-5, 1e-6
DIM = 8  # every sharded dim in the distributed checks (hidden, out features, vocabulary, classes)


def _close(actual, expected, what):
    """``assert_close`` for fp32 tensors without ``torch.testing``, whose first call costs seconds per rank."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, \
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
        err = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {err:.3g} over rtol {RTOL} / atol {ATOL}\n{actual}\n{expected}")


def _data(step, shape, salt=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + step))


def _ids(step, shape, high=DIM, salt=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(1000 * salt + step + 7))


def _cut(shard_mod, pname, t):
    """The slice of a full reference tensor that a shard's parameter ``pname`` holds."""
    if isinstance(shard_mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        return t.narrow(0, shard_mod.shard_start, shard_mod.shard_size)
    if isinstance(shard_mod, RowParallelLinear) and pname == "weight":
        return t.narrow(1, shard_mod.shard_start, shard_mod.shard_size)
    return t


def _param_pairs(shard, ref):
    for mname, sm in shard.named_modules():
        rm = ref.get_submodule(mname)
        for pname, p in sm.named_parameters(recurse=False):
            yield f"{mname}.{pname}", sm, pname, p, getattr(rm, pname)


def _train_compare(what, ref, shard, step_ref, step_shard, steps=3):
    """Run ``steps`` AdamW steps on both; ``step_*(model, step) -> (loss, [tensors])`` do their own backward
    and return tensors to compare pairwise (outputs mapped to the shard's layout, input gradients)."""
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_s = torch.optim.AdamW(shard.parameters(), lr=1e-3)
    for step in range(steps):
        opt_r.zero_grad()
        opt_s.zero_grad()
        loss_r, outs_r = step_ref(ref, step)
        loss_s, outs_s = step_shard(shard, step)
        _close(loss_s.detach(), loss_r.detach(), f"{what} loss step {step}")
        for i, (a, b) in enumerate(zip(outs_s, outs_r, strict=True)):
            _close(a.detach(), b.detach(), f"{what} tensor {i} step {step}")
        for name, sm, pname, p, full in _param_pairs(shard, ref):
            _close(p.grad, _cut(sm, pname, full.grad), f"{what} grad {name} step {step}")
        opt_r.step()
        opt_s.step()
    for name, sm, pname, p, full in _param_pairs(shard, ref):
        _close(p.detach(), _cut(sm, pname, full.detach()), f"{what} param {name} after {steps} steps")


def _check_collectives(group, sizes, rank):
    n = dist.get_world_size(group)
    sizes = sizes or shard_sizes(DIM, n)
    start, size = offsets(sizes)[rank], sizes[rank]
    for dim in (0, 1):
        full = _data(0, (DIM, 3) if dim == 0 else (3, DIM)).requires_grad_()
        w = _data(1, full.shape)
        local = scatter_to_group(full, group, dim, sizes)
        _close(local, full.detach().narrow(dim, start, size), f"scatter dim {dim}")
        y = gather_from_group(local * 2, group, dim, sizes)
        _close(y, 2 * full.detach(), f"gather dim {dim}")
        (y * w).sum().backward()
        _close(full.grad, 2 * w, f"scatter/gather grad dim {dim}")
    x = _data(2, (3, 4)).requires_grad_()
    reduce_from_group(x * (rank + 1), group).sum().backward()
    _close(x.grad, torch.full_like(x, rank + 1.0), "reduce_from_group backward is identity")
    x.grad = None
    (copy_to_group(x, group) * (rank + 1)).sum().backward()
    _close(x.grad, torch.full_like(x, n * (n + 1) / 2), "copy_to_group backward sums")


def _check_column_head(group, sizes):
    """Column-sharded classification head + sharded cross-entropy vs nn.Linear + F.cross_entropy."""
    ref = nn.Linear(6, DIM)
    col = ColumnParallelLinear(copy.deepcopy(ref), group, sizes)
    s, e = col.shard_start, col.shard_start + col.shard_size

    def step_ref(m, step):
        x = _data(step, (5, 6)).requires_grad_()
        y = m(x)
        loss = F.cross_entropy(y, _ids(step, (5,)))
        loss.backward()
        return loss, [y[:, s:e], x.grad]

    def step_shard(m, step):
        x = _data(step, (5, 6)).requires_grad_()
        y = m(x)
        loss = sharded_cross_entropy(y, _ids(step, (5,)), m.shard_start, group)
        loss.backward()
        return loss, [y, x.grad]

    _train_compare("column+CE", ref, col, step_ref, step_shard)


def _weighted_steps(make_x, sharded_input=None):
    """Step functions for loss = sum(y * w); ``sharded_input(x)`` feeds the shard a slice of x."""

    def step_ref(m, step):
        x = make_x(step).requires_grad_(make_x(step).is_floating_point())
        y = m(x)
        loss = (y * _data(step, y.shape, salt=3)).sum()
        loss.backward()
        if x.grad is None:
            return loss, [y]
        return loss, [y, x.grad if sharded_input is None else sharded_input(x.grad)]

    def step_shard(m, step):
        x = make_x(step)
        x = (x if sharded_input is None else sharded_input(x)).requires_grad_(x.is_floating_point())
        y = m(x)
        loss = (y * _data(step, y.shape, salt=3)).sum()
        loss.backward()
        return loss, [y] if x.grad is None else [y, x.grad]

    return step_ref, step_shard


def _check_linear_layers(group, sizes):
    ref = nn.Linear(6, DIM)
    col = ColumnParallelLinear(copy.deepcopy(ref), group, sizes, gather_output=True)
    _train_compare("column gathered", ref, col, *_weighted_steps(lambda st: _data(st, (2, 3, 6))))
    ref = nn.Linear(DIM, 4)
    row = RowParallelLinear(copy.deepcopy(ref), group, sizes, input_is_parallel=False)
    _train_compare("row full input", ref, row, *_weighted_steps(lambda st: _data(st, (5, DIM))))
    row = RowParallelLinear(copy.deepcopy(ref), group, sizes)
    cut = lambda t: t[:, row.shard_start:row.shard_start + row.shard_size]
    _train_compare("row parallel input", copy.deepcopy(ref), row,
                   *_weighted_steps(lambda st: _data(st, (5, DIM)), sharded_input=cut))
    ref = nn.Sequential(nn.Linear(6, DIM), nn.GELU(), nn.Linear(DIM, 4))
    mlp = shard_module(copy.deepcopy(ref), group, sizes)
    assert [type(m) for m in mlp] == [ColumnParallelLinear, nn.GELU, RowParallelLinear], mlp
    assert mlp[0].sizes == mlp[2].sizes == (sizes or shard_sizes(DIM, dist.get_world_size(group)))
    _train_compare("column->row MLP", ref, mlp, *_weighted_steps(lambda st: _data(st, (5, 6))))


def _check_embedding(group, sizes):
    ref = nn.Embedding(DIM, 5, padding_idx=3)
    emb = shard_module(copy.deepcopy(ref), group, sizes)
    assert isinstance(emb, VocabParallelEmbedding)
    _train_compare("vocab embedding", ref, emb, *_weighted_steps(lambda st: _ids(st, (4, 6))))


def _check_loss_functions(group, sizes, rank):
    n = dist.get_world_size(group)
    sizes = sizes or shard_sizes(DIM, n)
    start, size = offsets(sizes)[rank], sizes[rank]
    target = _ids(0, (6, 2))
    target[0, 1] = target[3, 0] = -100
    for reduction in ("mean", "sum", "none"):
        full = (_data(0, (6, 2, DIM)) * 3).requires_grad_()
        local = full.detach()[..., start:start + size].clone().requires_grad_()
        ref = F.cross_entropy(full.reshape(-1, DIM), target.reshape(-1), reduction=reduction)
        got = sharded_cross_entropy(local, target, start, group, reduction=reduction)
        _close(got, ref.view(got.shape), f"cross-entropy {reduction}")
        w = _data(1, ref.shape)
        (ref * w).sum().backward()
        (got * w.view(got.shape)).sum().backward()
        _close(local.grad, full.grad[..., start:start + size], f"cross-entropy grad {reduction}")
    ties = torch.randint(0, 3, (64, DIM), generator=torch.Generator().manual_seed(5)).float()
    labels = _ids(1, (64,))
    local = ties[:, start:start + size]
    pred = sharded_argmax(local, start, group)
    assert torch.equal(pred, ties.argmax(-1)), (pred, ties.argmax(-1))
    acc = sharded_accuracy(local, labels, start, group)
    _close(acc, (ties.argmax(-1) == labels).float().mean(), "accuracy")


def _check_errors(group, world):
    with pytest.raises(ValueError, match=r"size 3 into 4 shards"):
        ColumnParallelLinear(nn.Linear(2, 3), group)
    with pytest.raises(ValueError, match=r"add up to 9, but the dim has size 8"):
        RowParallelLinear(nn.Linear(DIM, 2), group, [2, 2, 2, 3])
    with pytest.raises(ValueError, match=r"3 shard sizes"):
        VocabParallelEmbedding(nn.Embedding(DIM, 2), group, [3, 3, 2])


def _subgroups(rank, world):
    """Two disjoint split groups of 2 ranks (split inside a replicate); each runs its own MLP shard."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    ref = nn.Sequential(nn.Linear(6, DIM), nn.ReLU(), nn.Linear(DIM, 4))
    mlp = shard_module(copy.deepcopy(ref), group, [5, 3])
    assert mlp[0].shard_start == (0 if rank % 2 == 0 else 5)
    _train_compare("MLP in subgroup", ref, mlp, *_weighted_steps(lambda st: _data(st + rank // 2, (5, 6))))


def _all_checks(rank, world, uneven):
    """Every check with equal sizes, then with ``uneven`` sizes; returns the configurations checked."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    done = []
    for sizes in (None, uneven):
        _check_collectives(group, sizes, rank)
        _check_column_head(group, sizes)
        _check_linear_layers(group, sizes)
        _check_embedding(group, sizes)
        _check_loss_functions(group, sizes, rank)
        done.append(sizes or shard_sizes(DIM, world))
    if world == 4:
        _check_errors(group, world)
        _subgroups(rank, world)
    return done


@pytest.mark.parametrize("world,uneven", [(2, [3, 5]), (4, [1, 2, 3, 2])], ids=["world2", "world4"])
def test_sharded_ops_match_single_process_even_and_uneven(world, uneven):
    """One process set per world size (spawning and first-use imports dominate the time)."""
    done = run_ranks(_all_checks, world, uneven)
    assert done == [[shard_sizes(DIM, world), uneven]] * world


# --- no processes: sizes, errors, registry, group of one -------------------------------------------------
def test_shard_sizes_equal_weighted_and_at_least_one():
    assert shard_sizes(8, 2) == [4, 4]
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(8, 2, weights=[3, 5]) == [3, 5]
    assert shard_sizes(100, 3, weights=[15.7, 10.6, 8.1]) == [46, 31, 23]
    assert shard_sizes(4, 3, weights=[1, 0, 0]) == [2, 1, 1]
    assert offsets([1, 2, 3, 2]) == [0, 1, 3, 6]


def test_more_shards_than_elements_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dim of size 3 into 4 shards: more shards than elements"):
        shard_sizes(3, 4)
    with pytest.raises(ValueError, match=r"dim of size 2 into 3 shards"):
        check_sizes([1, 1, 0], 2, 3)


def test_sizes_that_do_not_add_up_name_both_sums():
    with pytest.raises(ValueError, match=r"\[3, 4\] add up to 7, but the dim has size 8"):
        check_sizes([3, 4], 8, 2)
    with pytest.raises(ValueError, match=r"add up to 5, but the dim has size 8"):
        ColumnParallelLinear(nn.Linear(2, 8), None, [5])  # a group of one without torch.distributed


def test_unsupported_module_type_names_the_type_and_the_fix():
    with pytest.raises(SplitError, match=r"torch\.nn\.modules\.conv\.Conv2d.*register_split_rule\(Conv2d, rule\)"):
        shard_module(nn.Sequential(nn.Linear(4, 4), nn.Conv2d(1, 1, 3)))
    assert issubclass(SplitError, ValueError)


class _Head(nn.Module):
    def __init__(self, d, c):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, d))

    def forward(self, x):
        return x @ self.weight.t()


def test_registered_rule_and_group_of_one_equal_the_full_module():
    def shard_head(module, group, sizes, **ctx):
        lin = nn.Linear(module.weight.shape[1], module.weight.shape[0], bias=False)
        lin.weight = module.weight
        return ColumnParallelLinear(lin, group, sizes, gather_output=ctx.get("gather_output", False))

    register_split_rule(_Head, shard_head)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4), nn.Dropout(0.0),
                          _Head(4, 8))
    sharded = shard_module(model)
    assert [type(m).__name__ for m in sharded] == ["VocabParallelEmbedding", "ColumnParallelLinear", "Tanh",
                                                   "RowParallelLinear", "Dropout", "ColumnParallelLinear"]
    ids = torch.randint(0, 8, (3, 5))
    _close(sharded(ids), model(ids), "group of one")
    _close(sharded_cross_entropy(sharded(ids), torch.zeros(3, 5, dtype=torch.long), 0),
           F.cross_entropy(model(ids).reshape(-1, 8), torch.zeros(15, dtype=torch.long)), "CE group of one")


class _Container(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.fc = nn.Linear(4, 6)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_custom_container_is_walked_with_full_outputs_and_left_unmodified():
    model = _Container()
    sharded = shard_module(model)
    assert isinstance(sharded.emb, VocabParallelEmbedding) and isinstance(sharded.fc, ColumnParallelLinear)
    assert sharded.fc.gather_output, "unknown data flow inside a container: sharded children return full outputs"
    assert type(model.fc) is nn.Linear and type(model.emb) is nn.Embedding
    ids = torch.randint(0, 8, (2, 3))
    _close(sharded(ids), model(ids), "container, group of one")
