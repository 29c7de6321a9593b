"""Profiler: FLOPs and memory per layer unit on fake/meta tensors (issue 4, item 3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from whale.frontend.profile import (
    CPU_SDPA_FLOP_FORMULAS,
    InputSpec,
    ProfileError,
    default_units,
    flop_counter_mode,
    profile_model,
)

V, T, D, L, H = 256, 64, 128, 2, 4


class Attention(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T_, C = x.shape
        q, k, v = (t.view(B, T_, self.h, C // self.h).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T_, C))


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, h), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN GPT with learned positions and a head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(D, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


def lm_loss(logits, idx):
    return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


def tokens(b):
    return torch.randint(0, V, (b, T))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT()


@pytest.fixture(scope="module")
def gpt_profile(gpt):
    return profile_model(gpt, tokens, loss_fn=lm_loss)


def test_gpt_flops_match_6n_plus_attention(gpt, gpt_profile):
    p = gpt_profile
    assert [u.name for u in p.units] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f"]
    # Exact: every matmul weight (12 d^2 per block, plus the tied head V*d) costs 6 FLOPs per token in training,
    # attention 12 * L * T * d per token (forward QK^T and AV = 4 T d per layer, backward twice that).
    matmul_weights = L * 12 * D * D + V * D
    exact = 6 * matmul_weights + 12 * L * T * D
    assert p.train_flops / T == exact
    # Kaplan et al.: 6 x (non-embedding params + head) + attention, within a few percent (biases, LN add ~1%).
    non_embedding = sum(q.numel() for n, q in gpt.named_parameters() if not n.startswith(("wte", "wpe")))
    assert p.train_flops / T == pytest.approx(6 * (non_embedding + V * D) + 12 * L * T * D, rel=0.03)
    for u in p.units[2:4]:
        assert u.backward_flops == 2 * u.forward_flops
        assert u.forward_flops == (2 * 12 * D * D + 4 * T * D) * T
    assert p.rest.forward_flops == 2 * V * D * T  # the tied head runs in the root's forward
    assert p.units[0].forward_flops == 0 and p.units[4].train_flops == 0


def test_fake_cpu_meta_and_real_cpu_agree(gpt, gpt_profile):
    meta = profile_model(gpt, tokens, loss_fn=lm_loss, device="meta")
    for a, b in zip((*gpt_profile.units, gpt_profile.rest), (*meta.units, meta.rest), strict=True):
        assert (a.forward_flops, a.backward_flops) == (b.forward_flops, b.backward_flops)
        assert a.param_bytes == b.param_bytes
    idx = tokens(2)
    with flop_counter_mode() as counter:
        lm_loss(gpt(idx), idx).backward()
    gpt.zero_grad()
    assert counter.get_total_flops() / 2 == gpt_profile.train_flops
    # Real CPU SDPA runs the CPU flash kernel, which torch's FlopCounterMode would count as 0 without our formulas.
    ops = counter.get_flop_counts()["Global"]
    cpu_sdpa = [op for op in ops if op in CPU_SDPA_FLOP_FORMULAS]
    assert len(cpu_sdpa) == 2 and all(ops[op] > 0 for op in cpu_sdpa)


def test_memory_per_unit(gpt, gpt_profile):
    units = {u.name: u for u in gpt_profile.units}
    assert units["wte"].param_bytes == V * D * 4  # tied head weight counted once, in wte
    assert units["blocks.0"].param_bytes == 4 * sum(q.numel() for q in gpt.blocks[0].parameters())
    assert gpt_profile.rest.param_bytes == 0
    for u in gpt_profile.units:
        assert u.grad_bytes == u.param_bytes and u.optimizer_state_bytes == 2 * u.param_bytes
    total = sum(q.numel() for q in gpt.parameters()) * 4
    assert gpt_profile.static_bytes == 4 * total
    assert units["blocks.0"].activation_bytes == units["blocks.1"].activation_bytes > 20 * T * D * 4 / 2
    assert units["blocks.0"].output_bytes == T * D * 4
    assert gpt_profile.rest.activation_bytes >= T * V * 4  # cross-entropy keeps the log-softmax
    adam_free = profile_model(gpt, tokens, loss_fn=lm_loss, optimizer_state_factor=0.0, units=["blocks.0"])
    assert adam_free.units[0].optimizer_state_bytes == 0
    assert adam_free.rest.param_bytes == total - units["blocks.0"].param_bytes


def test_activation_bytes_exact_on_an_mlp():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for device in ("cpu", "meta"):
        p = profile_model(mlp, [InputSpec((8,))], batch_size=3, device=device)
        # Linear 0 saves its input (8 floats); ReLU saves its output (16); Linear 2 saves that same tensor again.
        assert [u.activation_bytes for u in p.units] == [32.0, 64.0, 0.0]
        assert [u.output_bytes for u in p.units] == [64.0, 64.0, 16.0]
        assert [u.forward_flops for u in p.units] == [2 * 8 * 16, 0, 2 * 16 * 4]
        assert p.units[0].backward_flops == 2 * 8 * 16  # input needs no grad: only the weight gradient
        assert p.units[2].backward_flops == 2 * 2 * 16 * 4
        real = torch.randn(3, 8)  # a callable may also return real tensors: only their metadata is used
        assert profile_model(mlp, lambda b, x=real: x, batch_size=3, device=device).units == p.units


def test_model_on_meta_profiles_the_same(gpt_profile):
    with torch.device("meta"):
        big = GPT()
    p = profile_model(big, tokens, loss_fn=lm_loss)
    assert p.train_flops == gpt_profile.train_flops and p.static_bytes == gpt_profile.static_bytes


def test_default_units_open_containers_and_trunks():
    class Trunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(4, 4)
            self.h = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)])) for _ in range(2))

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = Trunk()
            self.lm_head = nn.Linear(4, 4)

    assert default_units(Wrapper()) == ["transformer.wte", "transformer.h.0.0", "transformer.h.0.1.0",
                                        "transformer.h.1.0", "transformer.h.1.1.0", "lm_head"]
    assert default_units(nn.Linear(2, 2)) == [""]
    assert default_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == ["0", "1"]


def test_errors(gpt):
    with pytest.raises(ProfileError, match=r"unit 'block.0' is not a module of GPT; closest: \['blocks.0'"):
        profile_model(gpt, tokens, units=["block.0"])
    with pytest.raises(ProfileError, match="'blocks.0.attn' is inside 'blocks.0'"):
        profile_model(gpt, tokens, units=["blocks.0", "blocks.0.attn"])
    with pytest.raises(ProfileError, match="device must be"):
        profile_model(gpt, tokens, device="cuda")

    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) if x.sum().item() > 0 else x

    for device in ("cpu", "meta"):
        with pytest.raises(ProfileError, match="reads tensor values"):
            profile_model(ReadsValues(), [InputSpec((4,))], device=device)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ProfileError, match="does not require grad"):
        profile_model(frozen, [InputSpec((4,))])


def test_global_registration_is_idempotent_and_counts_cpu_sdpa():
    from torch.utils import flop_counter

    from whale.frontend.profile import register_cpu_sdpa_flop_formulas

    before = dict(flop_counter.flop_registry)
    q = torch.randn(1, 2, 8, 4)
    try:
        register_cpu_sdpa_flop_formulas()
        register_cpu_sdpa_flop_formulas()
        with flop_counter.FlopCounterMode(display=False) as counter:
            F.scaled_dot_product_attention(q, q, q)
        assert counter.get_total_flops() == 2 * 2 * (2 * 8 * 8 * 4)  # QK^T and AV over 2 heads
    finally:
        flop_counter.flop_registry.clear()
        flop_counter.flop_registry.update(before)


def test_example_gpt_matches_6n_plus_attention():
    """The main job's model (examples/gpt) against 6 x (non-embedding params + head) x tokens + attention."""
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=64)
    model = GPT(cfg, stages=1)
    T, D, L, V = cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.vocab_size
    p = profile_model(model, lambda b: torch.zeros(b, T, dtype=torch.long), batch_size=2)
    non_embedding = sum(q.numel() for n, q in model.named_parameters() if n.startswith("blocks."))
    kaplan = 6 * (non_embedding + V * D) + 12 * L * T * D
    assert p.train_flops / T == pytest.approx(kaplan, rel=0.03)
