"""What a Hugging Face user runs today on the same batches, for `benchmarks/gpu.py` (table 2), and the activation-
checkpointing row of table 5.

Every baseline trains the model of `gpu_models.llama3` as the HF Trainer does with `bf16=True`: fp32 weights under
bf16 autocast, fused AdamW, the global batch in rows of at most the context length (gradient accumulation over
rows, the loss summed over the batch's tokens through `num_items_in_batch`):
- `hf_flex`: `attn_implementation="flex_attention"`, rows packed with restarting `position_ids` (HF turns them into a
  document block mask), `torch.compile`;
- `hf_sdpa_per_sequence`: SDPA, one sequence per forward (no packing, so no mask), `torch.compile(dynamic=True)`;
- `hf_varlen`: torch's `varlen_attn` (FlashAttention's varlen kernel) fed the rows' `cu_seq_lens` as
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them, `torch.compile`;
- `hf_liger`: `hf_varlen` with Liger-Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy, eager (Liger's
  autograd functions fail under `torch.compile`'s fake tensors; Liger users run it eager).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.gpu_models import global_batch, llama3, measure, out_of_memory, pack_rows, packed_row, step_flops

BASELINES = ("hf_flex", "hf_sdpa_per_sequence", "hf_liger", "hf_varlen")
VARLEN = "bsc_varlen"
"""The name `hf_varlen` registers its attention function under."""
ATTENTION = {"hf_flex": "flex_attention", "hf_sdpa_per_sequence": "sdpa", "hf_varlen": VARLEN, "hf_liger": VARLEN}
"""Each baseline's `attn_implementation`."""
ROW_KEYS = {
    "sdpa": ("input_ids", "labels", "shift_labels"),
    "flex_attention": ("input_ids", "position_ids", "labels", "shift_labels"),
    VARLEN: None,
}
"""What each attention is fed of `packed_row` (None: all of it, the varlen offsets too): one sequence needs no
positions, a packed row restarts them, and varlen reads its `cu_seq_lens`."""


class Unavailable(RuntimeError):
    """A baseline this machine cannot run (a package or a torch feature is missing)."""


def varlen_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """HF attention interface over `torch.nn.attention.varlen.varlen_attn`: [1, heads, T, D] in, [1, T, heads, D]
    out, causal within each sequence of the row's `cu_seq_lens_q`."""
    from torch.nn.attention.varlen import varlen_attn

    # RoPE's fp32 cos/sin leave q and k in fp32 under autocast; the flash kernel takes the autocast dtype
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    q, k, v = (x.transpose(1, 2)[0].to(dtype) for x in (query, key, value))
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" in params:
        options: dict[str, Any] = {"enable_gqa": True}
    else:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        options = {}
    options.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    if kwargs.get("scaling") is not None and "scale" in params:
        options["scale"] = kwargs["scaling"]
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **options)
    return out[None], None


def _register_varlen() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"torch {torch.__version__} has no varlen_attn") from e
    AttentionInterface.register(VARLEN, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)  # no dense mask: the offsets carry it


def build(name: str, layers: int, smoke: bool) -> tuple[Any, Any]:
    """(the fp32 model, what runs it) for the baseline `name`."""
    device = "cpu" if smoke else "cuda"
    attention = ATTENTION[name]
    if smoke and attention == "flex_attention":
        raise Unavailable("flex_attention has no backward on the CPU")
    if attention == VARLEN:
        if smoke:
            raise Unavailable("varlen_attn runs on CUDA only")
        _register_varlen()
    if name == "hf_liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            raise Unavailable("liger_kernel is not installed") from e
        apply_liger_kernel_to_llama()
    model = llama3(layers, smoke, device, attention)
    if name == "hf_liger":  # Liger's autograd functions do not trace under torch.compile: its users run eager
        return model, model
    return model, torch.compile(model, dynamic=True if name == "hf_sdpa_per_sequence" else None)


def _rows(name: str, lengths: list[int], cap: int, vocab: int, device: str) -> list[dict[str, Any]]:
    """The forwards of one step: each sequence alone, or packed rows of at most `cap` tokens."""
    groups = [[n] for n in lengths] if name == "hf_sdpa_per_sequence" else pack_rows(lengths, cap)
    rows = [packed_row(g, vocab, device) for g in groups]
    keep = ROW_KEYS[ATTENTION[name]]
    return [{k: v for k, v in r.items() if keep is None or k in keep} for r in rows]


def run(
    name: str, layers: int, smoke: bool, batches: list[tuple[str, int]], cap: int, warmup: int, steps: int
) -> dict[str, Any]:
    """Table 2's rows of baseline `name`: every global batch trained `warmup + steps` times, then once profiled."""
    try:
        model, compiled = build(name, layers, smoke)
    except Unavailable as e:
        return {"unavailable": str(e)}
    device = "cpu" if smoke else "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device == "cuda")
    out = []
    for dataset, tokens in batches:
        lengths = global_batch(dataset, tokens, cap)
        rows = _rows(name, lengths, cap, model.config.vocab_size, device)
        losses: list[float] = []
        step = _step(compiled, optimizer, rows, torch.tensor(tokens - len(lengths), device=device), losses)
        m = measure(tokens, step_flops(layers, smoke, lengths), step, warmup, steps, {})
        optimizer.zero_grad(set_to_none=True)  # after a failed step too
        if m.error is None:
            m.extra = {"forwards": len(rows), "losses": [round(x, 4) for x in losses[-3:]]}
        out.append({"dataset": dataset, **asdict(m)})
    return {"rows": out}


def _step(
    model: Any, optimizer: torch.optim.Optimizer, rows: list[dict[str, Any]], items: torch.Tensor, losses: list[float]
) -> Callable[[], None]:
    """One optimizer step over `rows` under bf16 autocast, the loss of the whole batch appended to `losses`."""
    device = items.device.type

    def step() -> None:
        total = torch.zeros((), device=device)
        for row in rows:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(**row, num_items_in_batch=items).loss
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))

    return step


def checkpointing_longest(layers: int, smoke: bool, lengths: tuple[int, int]) -> dict[str, Any]:
    """Table 5's comparison: the same model, SDPA on one sequence, torch's activation checkpointing around every
    layer and our fused loss (so the logits do not decide), fp32 weights with AdamW's moments allocated (16 bytes
    per parameter, as the trainer's 18 less its reduce buffer). Peak memory at `lengths`, and the fitted longest."""
    from benchmarks.gpu_trainer import fit_longest
    from bytescale_compile.ops.loss import fused_linear_cross_entropy

    device = "cpu" if smoke else "cuda"
    model = llama3(layers, smoke, device, "sdpa")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    moments = [torch.zeros_like(p) for p in model.parameters() for _ in range(2)]
    peaks: list[int | None] = []
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            with torch.autocast(device, dtype=torch.bfloat16):
                hidden = model.model(input_ids=ids).last_hidden_state
                loss = fused_linear_cross_entropy(hidden[0], model.lm_head.weight, ids[0].roll(-1))
            loss.backward()
            peaks.append(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)
        except Exception as e:
            if not out_of_memory(e):
                raise
            peaks.append(None)
        model.zero_grad(set_to_none=False)
    del moments
    return fit_longest(lengths, peaks, smoke)
