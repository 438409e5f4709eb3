"""Patterns at the edge of what the passes match: rewritten only when equivalent, never a crash."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bytescale_compile as bsc
from tests.helpers import rel_err


class KeywordSDPA(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(query=q, key=q, value=q, is_causal=True)


class ValueHeadDim(nn.Module):
    """MLA-style: v has another head dim than q/k (DeepSeek-V3); the op takes it."""

    def forward(self, q, v):
        return F.scaled_dot_product_attention(q, q, v, is_causal=True)


class KeywordMaskedFill(nn.Module):
    def forward(self, q):
        t = q.shape[2]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        return torch.softmax((q @ q.transpose(-2, -1)).masked_fill(mask, value=float("-inf")), -1) @ q


class KeywordMatmul(nn.Module):
    def forward(self, q):
        t = q.shape[2]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        return torch.matmul(
            input=torch.softmax((q @ q.transpose(-2, -1)).masked_fill(mask, float("-inf")), -1), other=q
        )


class InPlaceThenAttention(nn.Module):
    """`y.mul_(2)` has an unused result; removing it as dead code would change the answer."""

    def forward(self, q):
        y = q * 1.0
        y.mul_(2)
        return F.scaled_dot_product_attention(y, y, y, is_causal=True)


class SegmentMask(nn.Module):
    """The position_ids segment-causal mask, as a bool mask (provable) or cast to 0/1 floats (added: not causal)."""

    def __init__(self, cast: bool):
        super().__init__()
        self.cast = cast

    def forward(self, q, positions):
        b, _, t, _ = q.shape
        seq = torch.cumsum(torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1, -1)
        bi = torch.arange(b)[:, None, None, None]
        qi, ki = torch.arange(t)[None, None, :, None], torch.arange(t)[None, None, None, :]
        mask = (seq[bi, qi] == seq[bi, ki]) & (positions[bi, ki] <= positions[bi, qi])
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask.to(q.dtype) if self.cast else mask)


class SoftTargets(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 10)

    def forward(self, h, probs):
        return F.cross_entropy(self.lm_head(h).view(-1, 10), probs.view(-1, 10))


class KeywordTarget(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 10)

    def forward(self, h, t):
        return F.cross_entropy(self.lm_head(h).view(-1, 10), target=t.view(-1), reduction="sum")


q = torch.randn(1, 2, 8, 4)
packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
CASES = {
    "sdpa keywords": (KeywordSDPA(), (q,), ("attention", 1, None)),
    "v head dim": (ValueHeadDim(), (q, torch.randn(1, 2, 8, 3)), ("attention", 1, None)),
    "masked_fill value=": (KeywordMaskedFill(), (q,), ("attention", 1, None)),
    "matmul keywords": (KeywordMatmul(), (q,), ("attention", 0, "matcher could not analyse")),
    "in-place kept": (InPlaceThenAttention(), (q,), ("attention", 1, None)),
    "bool segment mask": (SegmentMask(cast=False), (q, packed), ("attention", 1, None)),
    "float segment mask": (SegmentMask(cast=True), (q, packed), ("attention", 0, "is not where(bool_mask, 0, -inf")),
    "soft targets": (
        SoftTargets(),
        (torch.randn(1, 6, 4), torch.softmax(torch.randn(1, 6, 10), -1)),
        ("fused_loss", 0, "soft targets"),
    ),
    "target=": (KeywordTarget(), (torch.randn(1, 6, 4), torch.randint(0, 10, (1, 6))), ("fused_loss", 1, None)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_edge_pattern(name):
    model, inputs, (pass_name, rewrites, reason) = CASES[name]
    optimized = bsc.optimize(model)
    assert rel_err(optimized(*inputs), model(*inputs)) <= 1e-5
    report = optimized.report
    assert len(report.rewrites(pass_name)) == rewrites
    if reason:
        assert any(reason in s.reason for s in report.skipped(pass_name)), report.skipped(pass_name)


class ProjectedExplicitAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attend = KeywordMaskedFill()

    def forward(self, x):
        return self.attend(self.proj(x).view(1, -1, 2, 4).transpose(1, 2))


def test_saved_table_marks_tensors_quadratic_in_tokens():
    optimized = bsc.optimize(ProjectedExplicitAttention(), attention=False)
    optimized(torch.randn(1, 12, 8))
    saved = optimized.report.saved_activations
    quadratic = [a for a in saved if a.bytes_per_token is None]
    assert quadratic and all("T²" in a.decision for a in quadratic)
    assert any(a.bytes_per_token == 32 for a in saved)


def test_saved_table_needs_dynamic_tokens():
    optimized = bsc.optimize(ProjectedExplicitAttention(), dynamic=False)
    optimized(torch.randn(1, 12, 8))
    graph = optimized.report.graphs[0]
    assert not graph.saved_activations and "dynamic" in graph.saved_activations_note
