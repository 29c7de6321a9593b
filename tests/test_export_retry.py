"""torch.export's transient "fake tensor in the constant's list" refusal is retried; other failures are not."""

import gc

import pytest
import torch
from torch import nn

from whale.frontend import export as wexport
from whale.frontend.export import EXPORT_RETRIES, capture_inputs
from whale.frontend.graph import StageError


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.pos = nn.Embedding(8, 4)

    def forward(self, idx):  # [B, T] -> [B, T, 4]
        return self.emb(idx) + self.pos(torch.arange(idx.size(1)))


def _flaky(monkeypatch, failures: int, text: str) -> list[int]:
    real, calls = torch.export.export, []

    def export(*args, **kwargs):
        calls.append(gc.isenabled())
        if len(calls) <= failures:
            raise RuntimeError(text)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    return calls


TRANSIENT = ("We found a fake tensor in the exported program constant's list. This typically means our tracing "
             "system encountered an op that we can't trace through.")


def test_transient_refusal_is_retried_with_gc_paused(monkeypatch):
    calls = _flaky(monkeypatch, EXPORT_RETRIES, TRANSIENT)
    ep = wexport._export(_Tiny(), capture_inputs(torch.zeros(2, 5, dtype=torch.long)), ())
    assert len(calls) == EXPORT_RETRIES + 1 and not any(calls)  # collector paused during every attempt
    assert gc.isenabled()
    out = ep.module()(torch.zeros(3, 6, dtype=torch.long))
    assert out.shape == (3, 6, 4)


def test_persistent_refusal_and_other_errors_raise_stage_error(monkeypatch):
    calls = _flaky(monkeypatch, 99, TRANSIENT)
    with pytest.raises(StageError, match="torch.export.export"):
        wexport._export(_Tiny(), capture_inputs(torch.zeros(2, 5, dtype=torch.long)), ())
    assert len(calls) == EXPORT_RETRIES + 1 and gc.isenabled()
    calls = _flaky(monkeypatch, 1, "data-dependent branch")
    with pytest.raises(StageError, match="data-dependent branch"):
        wexport._export(_Tiny(), capture_inputs(torch.zeros(2, 5, dtype=torch.long)), ())
    assert len(calls) == 1
