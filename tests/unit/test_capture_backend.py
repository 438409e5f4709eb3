"""optimize() against the eager model: losses, every gradient, and what the report says was rewritten."""

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.models.llama import LlamaConfig, LlamaForCausalLM, tiny
from bytescale_compile.runtime.context import micro_batch
from tests.helpers import (
    assert_matches_eager,
    eager_copy,
    hf_llama,
    loss_and_grads,
    protocol_batch,
    rel_err,
)

ATTN, LOSS = "attention", "fused_loss"


def hf_tiny():
    return hf_llama(num_layers=2)


@pytest.mark.parametrize("repeat_kv", [False, True], ids=["enable_gqa", "repeat_kv"])
def test_own_llama_matches_eager(repeat_kv):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            repeat_kv=repeat_kv,
        )
    )
    eager = eager_copy(model)
    opt = bsc.optimize(model)
    assert_matches_eager(opt, eager, protocol_batch([37], vocab=128))
    report = opt.report
    assert len(report.rewrites(ATTN)) == 3 and not report.skipped(ATTN)
    assert len(report.rewrites(LOSS)) == 1
    if repeat_kv:
        assert all("repeat-kv unwrapped: 2 kv heads" in r.detail for r in report.rewrites(ATTN))
    assert [r.source for r in report.rewrites(ATTN)] == [f"layers.{i}.self_attn" for i in range(3)]


def test_hf_llama_matches_eager():
    model = hf_tiny()
    eager = eager_copy(model)
    opt = bsc.optimize(model)
    batch = protocol_batch([45], vocab=128, hf=True)
    assert_matches_eager(opt, eager, batch)
    assert len(opt.report.rewrites(ATTN)) == 2 and len(opt.report.rewrites(LOSS)) == 1


def test_hf_llama_packed_row_uses_position_ids_like_eager():
    """HF restricts attention to the segments where position_ids restart; so does the rewritten op."""
    model = hf_tiny()
    eager = eager_copy(model)
    opt = bsc.optimize(model)
    assert_matches_eager(opt, eager, protocol_batch([9, 1, 20], vocab=128, hf=True))
    assert all("segments from position_ids" in r.detail for r in opt.report.rewrites(ATTN))


@pytest.mark.parametrize("factory", ["own", "hf"])
def test_packed_row_equals_separate_sequences(factory):
    """Three sequences packed in one row with cu_seqlens in the context = the three run alone."""
    model = tiny() if factory == "own" else hf_tiny()
    hf = factory == "hf"
    opt = bsc.optimize(model)
    lens = [11, 3, 18]
    packed = protocol_batch(lens, vocab=128, hf=hf, seed=1)
    total = packed["num_items_in_batch"]
    with micro_batch(cu_seqlens=[0, 11, 14, 32]):
        loss, grads = loss_and_grads(opt, packed)
    separate_loss, separate = torch.zeros(()), {}
    start = 0
    for n in lens:
        one = {k: (v[:, start : start + n] if v.dim() else total) for k, v in packed.items()}
        l, g = loss_and_grads(opt, one)
        separate_loss += l
        for name, grad in g.items():
            separate[name] = separate.get(name, 0) + grad
        start += n
    assert rel_err(loss, separate_loss) <= 1e-5
    assert max(rel_err(grads[n], separate[n]) for n in grads) <= 1e-5


def test_explicit_attention_pattern_is_rewritten():
    class ExplicitAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-2, -1) / 8**0.5
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            return probs @ v

    torch.manual_seed(0)
    model = ExplicitAttention()
    x = torch.randn(2, 19, 32, requires_grad=True)
    opt = bsc.optimize(eager_copy(model))
    out = opt(x)
    ref = model(x)
    assert rel_err(out, ref) <= 1e-5
    grads = torch.autograd.grad(out.square().sum(), [x, *opt.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *model.parameters()])
    assert max(rel_err(a, b) for a, b in zip(grads, ref_grads)) <= 1e-5
    assert len(opt.report.rewrites(ATTN)) == 1


class Unsupported(nn.Module):
    """Four attentions the pass must leave alone, one per reason."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("bias", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))

    def forward(self, x, mask):
        q = self.proj(x).view(1, -1, 2, 8).transpose(1, 2)
        t = q.shape[2]
        a = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        b = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=False)
        c = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.5)
        scores = (q @ q.transpose(-2, -1)).masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        d = torch.softmax(scores, dim=-1) @ q
        return a + b + d, c


def test_unsupported_attention_stays_eager_and_is_reported():
    torch.manual_seed(0)
    model = Unsupported()
    opt = bsc.optimize(model)
    x, mask = torch.randn(1, 12, 16), torch.rand(1, 1, 12, 12) > 0.3
    out, _ = opt(x, mask)
    assert rel_err(out, model(x, mask)[0]) <= 1e-6
    report = opt.report
    assert not report.rewrites(ATTN)
    reasons = sorted(s.reason for s in report.skipped(ATTN))
    assert len(reasons) == 4, reasons
    assert any("attn_mask" in r for r in reasons)
    assert any("is_causal=False" in r for r in reasons)
    assert any("dropout" in r for r in reasons)
    assert any("mask" in r and "triu" in r for r in reasons)


def test_model_without_attention_compiles_with_zero_rewrites():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = bsc.optimize(model)
    x = torch.randn(3, 5, 8)
    assert rel_err(opt(x), model(x)) == 0
    report = opt.report
    assert len(report.graphs) == 1
    assert not report.rewrites(ATTN) and not report.rewrites(LOSS)
    assert not report.skipped(ATTN) and not report.skipped(LOSS)


def test_eval_mode_returns_logits_and_does_not_fuse():
    model = tiny()
    opt = bsc.optimize(model).eval()
    batch = protocol_batch([21], vocab=128)
    with torch.no_grad():
        out, ref = opt(**batch), model(**batch)
    assert out.logits.shape == (1, 21, 128)
    assert rel_err(out.logits, ref.logits) <= 1e-5 and rel_err(out.loss, ref.loss) <= 1e-5
    assert not opt.report.rewrites(LOSS)
    assert "eval mode" in opt.report.skipped(LOSS)[0].reason


def test_training_output_holds_loss_and_empty_logits():
    opt = bsc.optimize(tiny())
    out = opt(**protocol_batch([21], vocab=128))
    assert out.loss.requires_grad and out.logits.numel() == 0


def test_passes_switch_off_through_config():
    model = tiny()
    opt = bsc.optimize(model, attention=False, fused_loss=False, offload="off")
    assert_matches_eager(opt, eager_copy(model), protocol_batch([17], vocab=128))
    report = opt.report
    assert not report.rewrites(ATTN) and not report.rewrites(LOSS)
    assert [p.disabled for g in report.graphs for p in g.passes if p.disabled] == [
        "CompileConfig.attention=False",
        "CompileConfig.fused_loss=False",
        'CompileConfig.offload="off"',
    ]


def test_token_dimension_is_dynamic():
    """20 calls with lengths between 17 and 4096 compile at most twice."""
    opt = bsc.optimize(tiny())
    lengths = torch.linspace(17, 4096, 20).long().tolist()
    for n in lengths:
        opt(**protocol_batch([n], vocab=128))
    unique_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert unique_graphs <= 2, unique_graphs
    assert opt.compilations == unique_graphs


def test_report_contents():
    report = bsc.explain(tiny(), **protocol_batch([33], vocab=128))
    assert isinstance(report, bsc.CompileReport)
    graph = report.graphs[0]
    sdpa_call = "= torch._C._nn.scaled_dot_product_attention("
    assert sdpa_call in graph.graph_before
    assert "torch.ops.bytescale.attention.default(" in graph.graph_after and sdpa_call not in graph.graph_after
    assert "bytescale.fused_linear_cross_entropy" in graph.forward_graph
    saved = report.saved_activations
    assert saved and {a.layer for a in saved} >= {0, 1}
    assert all(a.bytes_per_token > 0 for a in saved)
    aliases = [a for a in saved if a.alias_of]  # q/k/v projections save views of one input
    assert aliases and all(a.alias_of in {b.name for b in saved} for a in aliases)
    md = report.to_markdown(graphs=True)
    assert "Pass `attention`: 2 rewritten" in md and "Saved activations" in md
    assert report.to_dict()["graphs"][0]["passes"][0]["name"] == ATTN


def test_hf_padding_mask_is_not_proved_causal():
    """A padding mask adds a term the matcher does not know: attention stays eager, output unchanged."""
    model = hf_tiny()
    opt = bsc.optimize(model)
    batch = protocol_batch([24], vocab=128, hf=True)
    batch["attention_mask"] = torch.ones(1, 24, dtype=torch.long)
    batch["attention_mask"][0, :3] = 0
    out = opt(**batch)
    ref = model(**batch)
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert not opt.report.rewrites(ATTN)
    assert all("padding mask" in s.reason for s in opt.report.skipped(ATTN))
    assert opt.shard_blockers()


def test_context_reaches_backward_run_on_another_thread():
    """Autograd runs accelerator backward on device threads: the context must be visible there."""
    import threading

    opt = bsc.optimize(tiny())
    packed = protocol_batch([11, 3, 18], vocab=128, seed=1)
    with micro_batch(cu_seqlens=[0, 11, 14, 32]):
        loss = opt(**packed).loss
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    grads = {n: p.grad.clone() for n, p in opt.named_parameters()}
    with micro_batch(cu_seqlens=[0, 11, 14, 32]):
        _, same_thread = loss_and_grads(opt, packed)
    assert max(rel_err(grads[n], same_thread[n]) for n in grads) == 0


def test_rope_angles_survive_a_bf16_cast():
    """Casting the model to bf16 must not cast RoPE's frequencies: bf16 ones are radians off at long positions."""
    from bytescale_compile.models.llama import Rotary

    rotary = Rotary(head_dim=64, theta=10000.0)
    positions = torch.tensor([[0, 1, 31_999, 32_000]])
    cos32, sin32 = rotary(positions, torch.float32)
    cos16, sin16 = rotary.to(torch.bfloat16)(positions, torch.bfloat16)
    assert (cos16.float() - cos32).abs().max() <= 2**-7 and (sin16.float() - sin32).abs().max() <= 2**-7
