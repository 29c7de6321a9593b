"""split shapes and sharding rules are checked at plan time (``wh.plan_model``, ``whale plan``), naming the module,
its type, the dim cut and its size, the device count and the fix, instead of failing later on every rank. No
process is started; the runtime's own checks (``shard_module``) still raise the same ``SplitError``."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

import whale as wh
import whale.splitrules as splitrules
from whale.splitrules import SplitError, register_split_rule

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Head(nn.Module):
    """One Linear under split(n) over n devices (a colocated replicate backbone shares them)."""

    def __init__(self, n=5, classes=4, d=8):
        super().__init__()
        with wh.replicate(n):
            self.backbone = nn.Linear(d, d)
        with wh.split(n):
            self.fc = nn.Linear(d, classes)

    def forward(self, x):
        return self.fc(self.backbone(x))


def too_narrow_head() -> nn.Module:
    """Factory for ``whale plan --model tests.test_split_plan_checks:too_narrow_head --world 5``."""
    torch.manual_seed(0)
    return _Head(5, classes=4)


def test_split_over_more_devices_than_out_features_fails_at_plan_time():
    with pytest.raises(SplitError, match=r"split over 5 devices cannot shard module 'fc' "
                                         r"\(torch\.nn\.modules\.linear\.Linear\): it cuts out_features, of size 4, "
                                         r"into 5 shards .*use at most 4 device\(s\) for this split, a larger "
                                         r"out_features, or register a split rule .*register_split_rule\(Linear, "):
        wh.plan_model(too_narrow_head(), 5)
    assert issubclass(SplitError, ValueError) and wh.SplitError is SplitError
    plan = wh.plan_model(_Head(4, classes=4), 4)  # as many classes as devices: fine
    assert plan.split_targets(0) == [("fc", plan.split_targets(0)[0][1])]


def test_width_one_shards_nothing_and_is_not_checked():
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            with wh.split(1):
                self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x):
            return self.conv(x)

    assert wh.plan_model(Conv(), 1).stage_width == 1


class _ConvUnderSplit(nn.Module):
    def __init__(self):
        super().__init__()
        with wh.replicate():
            self.stem = nn.Linear(4, 9)
        with wh.split():
            self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(1, 2, 3))

    def forward(self, x):
        return self.head(self.stem(x).view(-1, 1, 3, 3))


def test_a_module_type_without_a_rule_fails_at_plan_time_naming_it_and_the_fix():
    with pytest.raises(SplitError, match=r"split over 2 devices has no sharding rule for module 'head\.1' "
                                         r"\(torch\.nn\.modules\.conv\.Conv2d\), which holds parameters of its own "
                                         r"\(weight, bias\); register one before planning with "
                                         r"whale\.register_split_rule\(Conv2d, rule, dim_size=fn\)"):
        wh.plan_model(_ConvUnderSplit(), 2)


class _NestedPipe(nn.Module):
    """Two replicate(3) stages; stage 1 holds a split(3) MLP whose hidden width is 2."""

    def __init__(self, hidden=2, d=8):
        super().__init__()
        with wh.replicate(3):
            self.emb = nn.Embedding(16, d)
        with wh.replicate(3):
            with wh.split(3):
                self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, d))
            self.head = nn.Linear(d, 16)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.mlp(x))


def test_a_nested_split_in_a_replicate_stage_is_checked():
    with pytest.raises(SplitError, match=r"split over 3 devices cannot shard module 'mlp\.0' "
                                         r"\(torch\.nn\.modules\.linear\.Linear\), the column half of the Linear "
                                         r"pair 'mlp\.0' -> 'mlp\.3': it cuts out_features, of size 2, into 3 "
                                         r"shards"):
        wh.plan_model(_NestedPipe(hidden=2), 6, wh.Config(num_micro_batch=2))
    plan = wh.plan_model(_NestedPipe(hidden=3), 6, wh.Config(num_micro_batch=2))
    assert plan.num_stages == 2 and [n for n, _ in plan.split_targets(1)] == ["mlp"]


def test_an_embedding_under_split_is_bounded_by_its_vocabulary_and_options():
    class Emb(nn.Module):
        def __init__(self, vocab, **kw):
            super().__init__()
            with wh.split(4):
                self.emb = nn.Embedding(vocab, 8, **kw)

        def forward(self, idx):
            return self.emb(idx)

    with pytest.raises(SplitError, match=r"module 'emb' \(torch\.nn\.modules\.sparse\.Embedding\): it cuts "
                                         r"num_embeddings, of size 3, into 4 shards"):
        wh.plan_model(Emb(3), 4)
    with pytest.raises(SplitError, match=r"module 'emb' .*does not support max_norm or scale_grad_by_freq"):
        wh.plan_model(Emb(8, max_norm=1.0), 4)
    assert wh.plan_model(Emb(4), 4).stage_width == 4


class _Gate(nn.Module):
    """Owns its parameter directly, so it needs a registered rule; the rule cuts ``weight`` along dim 0."""

    def __init__(self, c, d=6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, d))

    def forward(self, x):
        return x @ self.weight.t()


class _GateModel(nn.Module):
    def __init__(self, c, gate=_Gate, n=4):
        super().__init__()
        with wh.replicate(n):
            self.stem = nn.Linear(6, 6)
        with wh.split(n):
            self.gate = gate(c)

    def forward(self, x):
        return self.gate(self.stem(x))


def _gate_rule(module, group, sizes, **ctx):  # never called at plan time
    raise AssertionError("plan time must not call the rule")


def test_a_registered_rule_with_dim_size_is_checked_and_one_without_is_accepted():
    class Gate(_Gate):  # a fresh type: the registry is global
        pass

    def Model(c):  # noqa: N802
        return _GateModel(c, Gate)

    with pytest.raises(SplitError, match=r"no sharding rule for module 'gate' .*Gate\), which holds parameters "
                                         r"of its own \(weight\)"):
        wh.plan_model(Model(8), 4)
    register_split_rule(Gate, _gate_rule, dim_size=lambda m: m.weight.shape[0])
    assert wh.plan_model(Model(8), 4).stage_width == 4
    with pytest.raises(SplitError, match=r"split over 4 devices cannot shard module 'gate' \(.*Gate\): it cuts the "
                                         r"dim its registered rule cuts \(dim_size of Gate\), of size 3, into 4 "
                                         r"shards.*use at most 3 device\(s\) for this split, a larger dim, or a rule "
                                         r"for Gate that cuts another dim"):
        wh.plan_model(Model(3), 4)
    register_split_rule(Gate, _gate_rule)  # no dim_size: accepted without a size check
    assert wh.plan_model(Model(3), 4).stage_width == 4
    register_split_rule(Gate, _gate_rule, dim_size=lambda m: "three")
    with pytest.raises(SplitError, match=r"dim_size registered for .*Gate returned 'three' for module 'gate'"):
        wh.plan_model(Model(3), 4)

    class SubGate(Gate):  # a subclass uses its base's rule and dim_size, as at run time
        pass

    register_split_rule(Gate, _gate_rule, dim_size=lambda m: m.weight.shape[0])
    assert splitrules.split_rule_for(SubGate) is _gate_rule
    with pytest.raises(SplitError, match=r"module 'sub' \(.*SubGate\): it cuts .*dim_size of Gate"):
        splitrules.check_split_module(nn.ModuleDict({"sub": SubGate(2)}), 4)


def test_register_split_rule_refuses_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_split_rule(int, _gate_rule)
    with pytest.raises(TypeError, match="dim_size must be None or callable"):
        register_split_rule(_Gate, _gate_rule, dim_size=3)


def test_the_whole_model_under_split_and_loose_parameters():
    with wh.split(4):
        whole = _Gate(3)  # the root module's own parameter: the runtime shards the whole model
    with pytest.raises(SplitError, match=r"no sharding rule for the whole model \(.*_Gate\)"):
        wh.plan_model(whole, 4)

    class Loose(nn.Module):
        def __init__(self):
            super().__init__()
            with wh.replicate(2):
                self.fc = nn.Linear(4, 4)
                self.sub = nn.Module()
                self.sub.shift = nn.Parameter(torch.zeros(4))
            with wh.split(2):
                self.sub.scale = nn.Parameter(torch.ones(4))  # half of 'sub' under split: not a whole module

        def forward(self, x):
            return self.fc(x) * self.sub.scale + self.sub.shift

    with pytest.raises(SplitError, match=r"split over 2 devices holds 'sub\.scale', which is not a whole module"):
        wh.plan_model(Loose(), 2)


def test_containers_are_walked_and_parameter_free_modules_pass():
    check = splitrules.check_split_module
    check(nn.ModuleDict({"a": nn.Linear(2, 4), "b": nn.Sequential(nn.ReLU(), nn.Embedding(4, 2))}), 4)
    check(nn.Sequential(nn.GELU(), nn.Dropout()), 64)
    with pytest.raises(SplitError, match=r"module 'x\.b\.1' \(torch\.nn\.modules\.sparse\.Embedding\)"):
        check(nn.ModuleDict({"a": nn.Linear(2, 4), "b": nn.Sequential(nn.ReLU(), nn.Embedding(3, 2))}), 4, "x")
    # a Linear pair is bounded by the first Linear only; a lone trailing Linear by its own out_features
    check(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2)), 4)
    with pytest.raises(SplitError, match=r"module '3' .*out_features, of size 2, into 4"):
        check(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2)), 4)


def test_whale_plan_refuses_such_a_model_in_one_line(capsys):
    from whale.cli import main

    rc = main(["plan", "--model", "tests.test_split_plan_checks:too_narrow_head", "--world", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "SplitError" in err and "module 'fc'" in err and "of size 4, into 5 shards" in err


def test_the_runtime_paths_still_raise_the_same_error():
    from whale.parallel import split, split_state
    from whale.parallel.split import shard_module

    assert split.SplitError is split_state.SplitError is SplitError is wh.SplitError
    assert split.register_split_rule is register_split_rule is wh.register_split_rule
    assert split.ELEMENTWISE is splitrules.ELEMENTWISE and split.split_rule_for is splitrules.split_rule_for
    assert split.split_rule_for(nn.Linear) is split._linear_rule
    with pytest.raises(SplitError, match=r"torch\.nn\.modules\.conv\.Conv2d.*register_split_rule\(Conv2d, rule\)"):
        shard_module(nn.Sequential(nn.Linear(4, 4), nn.Conv2d(1, 1, 3)))
    with pytest.raises(SplitError, match="max_norm or scale_grad_by_freq"):
        split.VocabParallelEmbedding(nn.Embedding(4, 2, scale_grad_by_freq=True))
    # with whale.parallel.split imported, the built-in types are still checked at plan time
    with pytest.raises(SplitError, match=r"module 'fc' .*of size 4, into 5 shards"):
        wh.plan_model(too_narrow_head(), 5)


def test_splitrules_imports_nothing_of_whale():
    tree = ast.parse((ROOT / "src" / "whale" / "splitrules.py").read_text())
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not any(n.startswith("whale") for n in names), names


class _ScaledLinear(torch.nn.Linear):
    """A Linear whose forward does more than a Linear: Whale's Linear rule would silently drop it."""

    def forward(self, x):
        return super().forward(x) * 3 + 1


class _OnlySubclassed(torch.nn.Linear):
    """A Linear subclass that keeps Linear's forward: it may use the Linear rule."""


def test_a_subclass_overriding_forward_does_not_inherit_a_rule():
    from whale.parallel.split import shard_module

    class Model(torch.nn.Module):
        def __init__(self, head_type):
            super().__init__()
            with wh.replicate():
                self.body = torch.nn.Linear(4, 4)
            with wh.split():
                self.head = head_type(4, 6)

        def forward(self, x):
            return self.head(self.body(x))

    with pytest.raises(wh.SplitError, match="_ScaledLinear overrides forward"):
        wh.plan_model(Model(_ScaledLinear), 2)
    with pytest.raises(wh.SplitError, match="overrides forward"):
        shard_module(_ScaledLinear(4, 6))
    assert wh.plan_model(Model(_OnlySubclassed), 2).task_graphs[1].kind == "split"
