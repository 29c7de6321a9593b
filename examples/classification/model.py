"""The classification model of Whale's flagship hybrid: a ResNet-style backbone under ``replicate`` and a
fully-connected head over C classes under ``split`` (paper §3, Fig. 4: ResNet-50 + a 100,000-class FC layer).

    images [B, in_channels, H, W]
      -> backbone (replicate: data parallel over all ranks)
           stem: conv3x3 (in_channels -> width) + GroupNorm + ReLU
           ``blocks`` residual blocks at ``width`` channels, H x W kept (conv3x3-GN-ReLU-conv3x3-GN + skip, ReLU)
           global average pool -> [B, width]
           projection -> [B, features]: Linear(width, features), or with ``hidden > 0`` the size knob
             Linear(width, hidden) + ReLU + Linear(hidden, features)
      -> head (split: class dim sharded over the same ranks): Linear(features, classes) -> logits [B, C]
         (under Whale: class-sharded logits, consumed by ``wh.cross_entropy`` / ``wh.accuracy``)

Normalization is **GroupNorm**: it normalizes each sample on its own. (BatchNorm works too: Whale computes its
statistics over the whole global batch across the data-parallel lanes, so training equals one process's and
the replicas' running statistics stay equal; GroupNorm simply needs no communication.)

The size knob. The paper's backbone (ResNet-50 without its FC) holds about 23.5 M fp32 parameters, "90 MB"
(MiB). Its compute does not matter for gradient synchronization, only its bytes do, so the benchmark reaches
those bytes cheaply: tiny images and a wide two-layer projection (``hidden``), whose parameters cost 2 FLOPs
each per sample. :func:`hidden_for_bytes` picks ``hidden`` for a target backbone size in bytes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import whale as wh


def _groups(channels: int) -> int:
    """GroupNorm groups: up to 8, dividing ``channels``."""
    return math.gcd(channels, 8)


class ResidualBlock(nn.Module):
    """Basic ResNet block: ``[B, c, H, W] -> [B, c, ceil(H / stride), ceil(W / stride)]``.

    With ``stride=2`` the first conv downsamples and the shortcut is a parameter-free 2x2 average pool.
    """

    def __init__(self, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(channels), channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(channels), channels)
        self.act = nn.ReLU()
        self.shortcut = nn.AvgPool2d(stride, ceil_mode=True) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.norm1(self.conv1(x)))
        return self.act(self.shortcut(x) + self.norm2(self.conv2(y)))


class Backbone(nn.Module):
    """ResNet-style feature extractor: images ``[B, in_channels, H, W]`` -> features ``[B, features]``.

    Args:
        width: channels of the stem and of every residual block.
        features: output feature dim (the head's input; 2,048 for ResNet-50).
        blocks: residual blocks.
        hidden: 0 for a single ``Linear(width, features)`` projection, else the hidden size of a two-layer
            projection (the size knob, see the module docstring).
        in_channels: image channels (1 for the digits, 3 for RGB).
    """

    def __init__(self, width: int, features: int, blocks: int = 2, hidden: int = 0, in_channels: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                  nn.GroupNorm(_groups(width), width), nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualBlock(width, 2 if i else 1) for i in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        if hidden:
            self.proj = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, features))
        else:
            self.proj = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.proj(self.pool(x).flatten(1))


class Classifier(nn.Module):
    """Backbone + fully-connected head over ``classes``: images -> logits ``[B, classes]``.

    With ``annotate=True`` the backbone is built under ``wh.replicate()`` and the head under ``wh.split()``
    (both over all ranks, colocated: needs ``num_micro_batch=1``); with ``annotate=False`` nothing is
    annotated and Whale runs the whole model data parallel (the default strategy).
    """

    def __init__(self, classes: int, features: int, width: int, blocks: int = 2, hidden: int = 0,
                 in_channels: int = 1, annotate: bool = True) -> None:
        super().__init__()
        if annotate:
            with wh.replicate():
                self.backbone = Backbone(width, features, blocks, hidden, in_channels)
            with wh.split():
                self.fc = nn.Linear(features, classes)
        else:
            self.backbone = Backbone(width, features, blocks, hidden, in_channels)
            self.fc = nn.Linear(features, classes)

        init_weights(self)

    def forward(self, x: torch.Tensor):
        return self.fc(self.backbone(x))


def init_weights(model: nn.Module) -> None:
    """He (Kaiming) normal init, fan-in, for every conv and linear weight; zero biases (GroupNorm keeps
    its default weight 1, bias 0).

    PyTorch's default (Kaiming-uniform with a = sqrt(5), variance 1 / (3 fan_in)) leaves the features and the
    logits small; with a padded head (``--classes-pad 1000``) training then sits on a plateau for hundreds of
    steps. Seeded by ``wh.init``, so every rank draws the same weights.
    """
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)


def build(classes: int, features: int, width: int, annotate: bool = True, blocks: int = 2, hidden: int = 0,
          in_channels: int = 1) -> Classifier:
    """The example classifier; see :class:`Classifier` and :class:`Backbone` for the arguments."""
    return Classifier(classes, features, width, blocks, hidden, in_channels, annotate)


def num_params(module: nn.Module) -> int:
    """Number of parameters (elements)."""
    return sum(p.numel() for p in module.parameters())


def backbone_params(width: int, features: int, blocks: int = 2, hidden: int = 0, in_channels: int = 1) -> int:
    """Parameters of a :class:`Backbone` with these arguments, counted on the meta device (no memory)."""
    with torch.device("meta"):
        return num_params(Backbone(width, features, blocks, hidden, in_channels))


def head_params(classes: int, features: int) -> int:
    """Parameters of the head ``Linear(features, classes)``: weight plus bias."""
    return classes * (features + 1)


def hidden_for_bytes(target_bytes: int, width: int, features: int, blocks: int = 2, in_channels: int = 1,
                     itemsize: int = 4) -> int:
    """The ``hidden`` size whose backbone holds as close to ``target_bytes`` of weights as possible.

    The backbone's parameter count is affine in ``hidden``: ``P(h) = P(0) - width*features + h*(width + 1 +
    features)`` (the two-layer projection replaces the single one), so this solves for h and rounds.
    E.g. ``hidden_for_bytes(90 * 2**20, 64, 2048)`` gives a ~90 MiB backbone like ResNet-50's.

    Raises:
        ValueError: the target is smaller than the backbone without the projection's hidden layer.
    """
    base = backbone_params(width, features, blocks, 0, in_channels) - width * features
    per_hidden = width + 1 + features
    h = round((target_bytes / itemsize - base) / per_hidden)
    if h < 1:
        raise ValueError(f"a backbone of width {width} already holds {base * itemsize:,} bytes > target "
                         f"{target_bytes:,}: lower width/blocks or raise the target")
    return h
