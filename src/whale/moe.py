"""A Mixture-of-Experts feed-forward layer (one process) and its routing math, shared with expert parallelism.

``MoE(d_model, d_ff, num_experts, top_k)`` replaces a transformer's FFN: a linear router scores each token
against ``E`` experts, each token goes to its ``top_k`` best experts (each a two-layer FFN), and its output is
the gate-weighted sum of their outputs. Under ``wh.split`` the experts are spread over the split's devices and
tokens travel to them by all-to-all (expert parallelism, :mod:`whale.parallel.moe`); the numbers do not change.

**Routing group = one sample.** Each row of dim 0 of the input (one sequence, GShard's "group", Lepikhin et al.
2020 §2.2) is routed on its own: ``T`` = the tokens of one row (the product of the dims between the first and
the last). Per sample and expert the **capacity** is ``C = ceil(capacity_factor * T * top_k / E)`` tokens;
slots are taken in GShard's order -- every token's first choice before any second choice, then token position --
and a (token, choice) beyond ``C`` is **dropped** (it contributes nothing; add a residual around the layer).
``capacity_factor=None`` is **dropless**: nothing is dropped. The losses are per-sample too and averaged over
samples:

- load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4): ``E * sum_e f_e * P_e``, with ``f_e``
  the fraction of the sample's tokens whose FIRST choice is expert e (before dropping) and ``P_e`` the mean
  router probability of e over the sample's tokens; 1.0 when the routing is uniform;
- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over the sample's tokens of
  ``logsumexp(router logits)^2``.

Because drops and losses depend on one sample only, they do not depend on how the rows of a batch are split
over data-parallel ranks or micro-batches: a rank can decide its drops locally before dispatching, and Whale's
weighting of each rank's loss by rows / global batch makes the sum of the ranks' per-sample means the global
mean. The gates: with ``top_k = 1`` the chosen expert's router probability (Switch); with ``top_k >= 2`` the
top-k probabilities renormalized to sum to 1 (GShard), before any drop.

**Adding the losses.** Each forward stores ``layer.aux_loss``, a differentiable 0-dim fp32 tensor
``aux_loss_coef * load_loss + z_loss_coef * z_loss`` (0 when both coefficients are 0); ``moe_aux_loss(model)``
sums it over every MoE layer of the model. A training loss is ``task_loss + wh.moe_aux_loss(model)``, for
example ``loss_fn=lambda out, y: F.cross_entropy(out, y) + wh.moe_aux_loss(model)`` for ``wh.parallelize``
(the task loss must be a per-sample mean for the weighting above to hold).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from whale.plan.plan import MoELayer, PlanError
from whale.splitrules import SplitError, _register_builtin_check, split_modules

__all__ = ["MoE", "Routing", "route", "route_tokens", "capacity", "expert_ffn", "combine", "moe_aux_loss"]

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Slots per expert per sample, ``ceil(capacity_factor * tokens * top_k / num_experts)`` (GShard §2.2);
    ``None`` when dropless (``capacity_factor=None``)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


@dataclass
class Routing:
    """Where each token of ``S`` samples x ``T`` tokens goes (``k`` = top_k).

    Attributes:
        experts: int64 ``[S, T, k]``, the chosen expert of each (token, choice).
        gates: float ``[S, T, k]``, its weight in the token's output (differentiable in the router logits).
        keep: bool ``[S, T, k]``, False where the (token, choice) is dropped for lack of capacity.
        load_loss: 0-dim, the Switch load-balancing loss averaged over samples.
        z_loss: 0-dim, the router z-loss averaged over samples.
    """

    experts: torch.Tensor
    gates: torch.Tensor
    keep: torch.Tensor
    load_loss: torch.Tensor
    z_loss: torch.Tensor


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None) -> Routing:
    """Top-k routing of router logits ``[S, T, E]`` (fp32 recommended) per sample (module docstring).

    Raises:
        ValueError: ``logits`` not 3-D, or ``top_k`` outside ``[1, E]``.
    """
    if logits.dim() != 3:
        raise ValueError(f"route expects router logits [samples, tokens, experts], got shape {tuple(logits.shape)}")
    s, t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    probs = logits.softmax(-1)
    top, experts = probs.topk(top_k, dim=-1)  # [S, T, k], ties to the lower expert index
    gates = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    keep = _keep(experts, e, capacity(t, top_k, e, capacity_factor))
    if s == 0 or t == 0:
        zero = logits.sum() * 0.0
        return Routing(experts, gates, keep, zero, zero)
    first = F.one_hot(experts[..., 0], e).to(probs.dtype)  # [S, T, E]
    load = e * (first.mean(1) * probs.mean(1)).sum(-1)  # [S]: E * sum_e f_e P_e (Switch eq. 4)
    z = logits.logsumexp(-1).pow(2).mean(1)  # [S] (ST-MoE eq. 5)
    return Routing(experts, gates, keep, load.mean(), z.mean())


def _keep(experts: torch.Tensor, num_experts: int, cap: int | None) -> torch.Tensor:
    """Bool ``[S, T, k]``: the (token, choice) got one of its expert's ``cap`` slots in its sample, slots taken
    choice-major then by position (GShard); all True when ``cap`` is None (dropless)."""
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    s, t, k = experts.shape
    onehot = F.one_hot(experts.transpose(1, 2).reshape(s, k * t), num_experts)  # [S, k*T, E], choice-major
    slot = ((onehot.cumsum(1) - 1) * onehot).sum(-1)  # [S, k*T]: the slot each (choice, token) takes
    return (slot < cap).reshape(s, k, t).transpose(1, 2)


def expert_ffn(x: torch.Tensor, counts: list[int], w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
               b2: torch.Tensor | None, activation: str) -> torch.Tensor:
    """Run expert i on the next ``counts[i]`` rows of ``x`` ``[sum(counts), d]`` (rows grouped by expert):
    ``act(x @ w1[i] + b1[i]) @ w2[i] + b2[i]`` with ``w1 [E, d, f]``, ``w2 [E, f, d]``. Returns ``[rows, d]``.
    FLOPs: 4 * rows * d * f forward."""
    outs = []
    act = _ACTIVATIONS[activation]
    for i, xi in enumerate(x.split(counts)):
        h = xi @ w1[i] + (b1[i] if b1 is not None else 0)
        outs.append(act(h) @ w2[i] + (b2[i] if b2 is not None else 0))
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def dispatch_order(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The M kept (token, choice) pairs sorted by expert (stable: then by token, then choice).

    Returns ``(token, expert, gate)``: the flat token index into the ``S*T`` tokens (int64 ``[M]``), the expert
    (int64 ``[M]``) and the gate (``[M]``, differentiable)."""
    k = routing.experts.shape[-1]
    flat_keep = routing.keep.reshape(-1)
    pair = flat_keep.nonzero().squeeze(1)  # index into S*T*k, token-major
    expert = routing.experts.reshape(-1)[pair]
    order = torch.sort(expert, stable=True).indices
    pair, expert = pair[order], expert[order]
    return pair // k, expert, routing.gates.reshape(-1)[pair]


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer (module docstring): ``[..., d_model] -> [..., d_model]``.

    Args:
        d_model: token width d.
        d_ff: hidden width f of each expert's FFN.
        num_experts: E >= 1.
        top_k: experts per token, in ``[1, E]`` (1 = Switch, 2 = GShard).
        capacity_factor: slots per expert and sample = ``ceil(capacity_factor * T * top_k / E)``; ``None``
            (default) = dropless.
        aux_loss_coef: weight of the Switch load-balancing loss in :attr:`aux_loss` (Switch used 1e-2).
        z_loss_coef: weight of the router z-loss in :attr:`aux_loss` (ST-MoE used 1e-3).
        activation: ``"gelu"``, ``"relu"`` or ``"silu"``.
        bias: whether the experts' linear maps have biases.

    Parameters: ``router.weight [E, d]`` (no bias); ``w1 [E, d, f]``, ``b1 [E, f]``, ``w2 [E, f, d]``,
    ``b2 [E, d]`` -- experts stacked along dim 0, which expert parallelism shards.

    Attributes:
        aux_loss: after a forward, 0-dim fp32 ``aux_loss_coef * load_loss + z_loss_coef * z_loss``; ``None``
            before the first forward. Sum it over a model with :func:`moe_aux_loss`.
        last_routing: the :class:`Routing` of the latest forward (for inspection: which tokens were dropped).

    Raises:
        ValueError: a size below 1, ``top_k`` larger than ``num_experts`` (naming both), a capacity factor
            that is not positive, negative coefficients, an unknown activation.
    """

    is_moe = True  # moe_aux_loss collects aux_loss from every module with this flag (expert-parallel ones too)

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 activation: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        _check_config(d_model, d_ff, num_experts, top_k, capacity_factor, aux_loss_coef, z_loss_coef, activation)
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.capacity_factor, self.activation = capacity_factor, activation
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.b1 = nn.Parameter(torch.empty(num_experts, d_ff)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model)) if bias else None
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear``'s default: uniform(+-1/sqrt(fan_in)) weights and biases."""
        for w, b, fan_in in ((self.w1, self.b1, self.d_model), (self.w2, self.b2, self.d_ff)):
            bound = fan_in ** -0.5
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[S, ..., d]`` (row = one sample, its tokens the middle dims) -> ``[S, ..., d]``."""
        tokens, routing = route_tokens(self, x)
        if torch.compiler.is_exporting():  # shapes that depend on the routing cannot be exported: go dense
            return _dense(self, tokens, routing).reshape(x.shape).to(x.dtype)
        if not _has_values(x):  # profiling on fake tensors: the FLOPs and sizes of a uniform routing
            return _uniform(self, tokens, routing).reshape(x.shape).to(x.dtype)
        token, expert, gate = dispatch_order(routing)
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        y = expert_ffn(tokens[token], counts, self.w1, self.b1, self.w2, self.b2, self.activation)
        return combine(y, token, gate, tokens.shape[0], x)

    def extra_repr(self) -> str:
        """Sizes and routing options for ``print(module)``."""
        cap = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"{cap}, aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}")


def route_tokens(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """``x`` ``[S, ..., d]`` as tokens ``[S*T, d]`` and their :class:`Routing` by ``layer``'s router (an
    :class:`MoE` or its expert-parallel shard: ``router.weight``, sizes and options); sets ``layer.aux_loss``
    and ``layer.last_routing``. The routing math runs in fp32 (the router logits ``[S, T, E]`` are cast before
    the softmax).

    Raises:
        ValueError: ``x`` has fewer than 2 dims or a last dim other than ``d_model``.
    """
    if x.dim() < 2 or x.shape[-1] != layer.d_model:
        raise ValueError(f"MoE expects input [samples, ..., d_model={layer.d_model}], got shape {tuple(x.shape)}")
    tokens = x.reshape(-1, layer.d_model)
    logits = F.linear(tokens, layer.router.weight).float().reshape(x.shape[0], -1, layer.num_experts)
    routing = route(logits, layer.top_k, layer.capacity_factor)
    if _has_values(x) and not torch.compiler.is_exporting():  # a capture's fake tensors are no loss to keep
        layer.aux_loss = layer.aux_loss_coef * routing.load_loss + layer.z_loss_coef * routing.z_loss
        layer.last_routing = routing
    return tokens, routing


def _dense(layer: MoE, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The same output as the sparse path with data-independent shapes: every expert on every token
    ``[E, N, f]``, each token's kept gates scattered into ``[N, E]`` (E times the FLOPs; used while
    ``torch.export`` captures a pipeline, where the layer is then one opaque call anyway)."""
    n, k = tokens.shape[0], layer.top_k
    gates = (routing.gates * routing.keep).reshape(n, k)
    dense = gates.new_zeros(n, layer.num_experts).scatter_add(1, routing.experts.reshape(n, k), gates)
    h = torch.einsum("nd,edf->enf", tokens, layer.w1) + (layer.b1[:, None] if layer.b1 is not None else 0)
    y = torch.einsum("enf,efd->end", _ACTIVATIONS[layer.activation](h), layer.w2)
    y = y + (layer.b2[:, None] if layer.b2 is not None else 0)
    return torch.einsum("ne,end->nd", dense.to(y.dtype), y)


def _uniform(layer: MoE, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    """A stand-in with data-independent shapes for profiling on fake tensors: each token's ``top_k`` copies
    spread evenly over the experts, so the FLOPs (``4 N k d f`` forward) and activation sizes are a uniform
    dropless routing's; the values are not the layer's (fake tensors have none)."""
    n, k = tokens.shape[0], layer.top_k
    q, r = divmod(n * k, layer.num_experts)
    counts = [q + (i < r) for i in range(layer.num_experts)]
    y = expert_ffn(tokens.repeat_interleave(k, 0), counts, layer.w1, layer.b1, layer.w2, layer.b2, layer.activation)
    return (y.reshape(n, k, -1) * routing.gates.reshape(n, k, 1).to(y.dtype)).sum(1)


def _has_values(x: torch.Tensor) -> bool:
    """Whether ``x`` holds real values (not a meta or fake tensor of a profile or a trace)."""
    return not (x.is_meta or isinstance(x, FakeTensor))


def combine(y: torch.Tensor, token: torch.Tensor, gate: torch.Tensor, num_tokens: int,
            like: torch.Tensor) -> torch.Tensor:
    """Sum each (token, choice)'s expert output ``y [M, d]`` times its gate into its token: ``[*like.shape]``."""
    out = y.new_zeros(num_tokens, y.shape[-1])
    out = out.index_add(0, token, y * gate.unsqueeze(-1).to(y.dtype))
    return out.reshape(like.shape).to(like.dtype)


def _check_config(d_model, d_ff, num_experts, top_k, capacity_factor, aux_coef, z_coef, activation) -> None:
    for name, v in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"MoE {name}={v!r} must be an int >= 1")
    if top_k > num_experts:
        raise ValueError(f"MoE top_k={top_k} is larger than num_experts={num_experts}: a token cannot visit more "
                         f"experts than exist; use top_k <= {num_experts} or more experts")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"MoE capacity_factor={capacity_factor!r} must be a number > 0, or None (dropless)")
    if not (aux_coef >= 0 and z_coef >= 0):
        raise ValueError(f"MoE aux_loss_coef={aux_coef!r} and z_loss_coef={z_coef!r} must be >= 0")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"MoE activation={activation!r} is not one of {sorted(_ACTIVATIONS)}")


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of :attr:`MoE.aux_loss` over every MoE layer of ``model`` that ran a forward (expert-parallel shards
    included): a differentiable 0-dim fp32 tensor to add to the task loss (0 when there is none)."""
    losses = [m.aux_loss for m in model.modules() if getattr(m, "is_moe", False) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float32)



def _moe_dims(module: MoE, fqn: str, n: int) -> None:
    """Plan-time check of an expert-parallel split (:mod:`whale.splitrules`): at least one expert per device."""
    if module.num_experts >= n:
        return
    where = f"module {fqn!r}" if fqn else "the whole model"
    raise SplitError(
        f"split over {n} devices cannot place the experts of {where} (whale.MoE): it has num_experts="
        f"{module.num_experts}, fewer than the {n} devices, and expert parallelism puts at least one whole expert "
        f"on each device (experts are not replicated); use at most {module.num_experts} device(s) for this split: "
        f"put it in a wh.replicate({module.num_experts}) (nested data parallelism then copies that group over the "
        f"other devices), or build the layer under wh.replicate(...) instead of split, or use more experts")


_register_builtin_check(MoE, _moe_dims)


def with_moe_layers(model: nn.Module, plan):
    """``plan`` with :attr:`~whale.plan.plan.Plan.moe_layers` listing the MoE layers it runs under split (expert
    parallelism), for the printout (pure; used by the front end).

    Raises:
        SplitError: an MoE layer lies inside a split target instead of being one (expert parallelism needs the
            layer itself as the split module: a container around it would gather every rank's rows into it).
    """
    if not plan.uniform_width or plan.stage_width <= 1:
        return plan
    layers = []
    for stage in range(plan.num_stages):
        for name, _ in split_modules(model, plan.split_targets(stage)):
            for sub, m in model.get_submodule(name).named_modules():
                if isinstance(m, MoE) and sub:
                    raise SplitError(
                        f"the MoE layer {'.'.join(filter(None, (name, sub)))!r} lies inside the split module "
                        f"{name or '<the whole model>'!r}: expert parallelism needs the MoE layer itself as the "
                        "split module; build only the MoE layer under wh.split (the rest under wh.replicate)")
                if isinstance(m, MoE):
                    per_expert = sum(p.numel() for p in (m.w1, m.b1, m.w2, m.b2) if p is not None) // m.num_experts
                    layers.append(MoELayer(name, m.num_experts, m.top_k, per_expert))
    return dataclasses.replace(plan, moe_layers=tuple(layers)) if layers else plan



def check_aux_stages(model: nn.Module, plan) -> None:
    """Refuse an MoE layer with an auxiliary loss in a pipeline stage before the last: the loss function runs on
    the last stage only, so that layer's :attr:`MoE.aux_loss` would silently be left out of training.

    Raises:
        PlanError: naming the layer, its coefficients, its stage and the fixes.
    """
    if plan.num_stages < 2 or not plan.stage_cuts:
        return
    where = {p: s for s, cut in enumerate(plan.stage_cuts) for p in cut.params}
    for name, m in model.named_modules():
        stage = where.get(f"{name}.router.weight" if name else "router.weight")
        if isinstance(m, MoE) and (m.aux_loss_coef or m.z_loss_coef) and stage is not None \
                and stage < plan.num_stages - 1:
            raise PlanError(
                f"the MoE layer {name!r} has aux_loss_coef={m.aux_loss_coef}, z_loss_coef={m.z_loss_coef} but runs "
                f"in pipeline stage {stage} of {plan.num_stages}; the loss function runs on the last stage only, "
                "so whale.moe_aux_loss(model) there cannot add this layer's auxiliary loss. Put MoE layers with "
                "auxiliary losses in the last stage, set both coefficients to 0 in earlier stages, or train "
                "without a pipeline")
