"""Model FLOPs of a training step, the TFLOP/s each device achieved, and MFU against the device's peak.

Counted the way Megatron-LM, PaLM and torchtitan count model FLOPs: matmuls only, 2 FLOPs per
multiply-add, backward twice the forward, whatever the run recomputes or pads. So MFU compares runs and
strategies on the work the model needs, not on the work a schedule happened to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..planner.model_shape import ModelShape

__all__ = ["PEAK_TFLOPS", "TRAINING_FACTOR", "achieved", "model_flops", "peak_tflops"]

TRAINING_FACTOR = 3
"""Forward + backward FLOPs over forward FLOPs: the backward computes gradients of both the activations and
the weights, each as costly as the forward."""

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "bf16": {
        "H100 PCIe": 756.0,
        "H100 NVL": 835.0,
        "H200 NVL": 835.0,
        "H100": 989.0,
        "H200": 989.0,
        "B200": 2250.0,
        "A100": 312.0,
        "A10G": 125.0,
        "A10": 125.0,
        "L40S": 362.0,
        "RTX 4090": 165.2,
        "MI300X": 1307.4,
    },
    "fp32": {
        "H100 PCIe": 378.0,
        "H100 NVL": 417.5,
        "H100": 494.7,
        "H200": 494.7,
        "A100": 156.0,
        "A10": 62.5,
        "L40S": 183.0,
        "RTX 4090": 82.6,
    },
}
"""Dense (no sparsity) peak TFLOP/s of one device by a substring of its `torch.cuda.get_device_name`, tried in
order (the specific names first: "H100 PCIe" before "H100", "A100" before "A10"). bf16 with fp32
accumulation (fp16 peaks are the same); "fp32" is the TF32 tensor-core peak, which fp32 matmuls reach only
with TF32 enabled (`torch.set_float32_matmul_precision("high")`)."""


def model_flops(shape: ModelShape, lengths: Sequence[int] | np.ndarray, mixer_layers: int = 0) -> float:
    """Training FLOPs (forward + backward) of one optimizer step over sequences of `lengths` tokens.

    Per token, forward: every layer's matmuls, `ModelShape.linear_flops_per_token` = 2 x (the q, k, v
    projections, k and v with the GQA `kv_heads`: hidden x (hidden + 2 x kv_heads x head_dim); the output
    projection, hidden x hidden; the gated MLP's gate, up and down, 3 x hidden x ffn for each of the `top_k`
    experts a token is routed to), plus the LM head, 2 x hidden x vocab.

    Per sequence of s tokens and attention layer, forward: causal attention's scores QK^T and its
    weighted sum PV, each heads x head_dim multiply-adds for each of the s (s + 1) / 2 query-key pairs the
    causal mask keeps (a token attends to itself and those before it): 2 x 2 x heads x head_dim x
    s (s + 1) / 2. Packed sequences do not attend to each other, so each sequence counts on its own.

    `mixer_layers` (`CostModel.mixer_layers`): of the shape's layers, those whose token mixer is a convolution
    or a scan (hybrid models). They have no attention term; their projections are counted as an attention
    layer's (ModelShape has no other size for them) and the scan or convolution itself, not a matmul, is not
    counted.

    Not counted: the embedding lookup, norms, activations, softmax, RoPE and the loss (not matmuls); an
    MoE router's hidden x experts matmul. ModelShape records no gate flag, so every MLP counts as gated, as
    the cost model does (3 matrices where a GPT-style MLP has 2), and its head_dim is hidden // heads (a
    config that sets a wider head_dim has more attention FLOPs than counted here).
    """
    if not 0 <= mixer_layers <= shape.layers:
        raise ValueError(f"mixer_layers must be in [0, layers={shape.layers}] of {shape.name}, got {mixer_layers}")
    s = _lengths(lengths)
    tokens = int(s.sum())
    causal_pairs = int((s * (s + 1) // 2).sum())
    per_token = shape.layers * shape.linear_flops_per_token + 2 * shape.hidden * shape.vocab
    per_pair = (shape.layers - mixer_layers) * 2 * 2 * shape.heads * shape.head_dim
    return float(TRAINING_FACTOR * (tokens * per_token + causal_pairs * per_pair))


def peak_tflops(device: torch.device, dtype: str, override: float | None = None) -> float | None:
    """Peak dense TFLOP/s of one `device` computing in `dtype` ("bf16", "fp16" or "fp32"): `override` when
    given, else `PEAK_TFLOPS`'s entry for the CUDA device's name. None where no honest peak is known: a CPU,
    a device not in the table, fp32 matmuls without TF32. MFU is then not reported."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"the peak TFLOP/s override must be > 0, got {override}")
        return float(override)
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype!r}")
    if device.type != "cuda":
        return None
    if dtype == "fp32" and torch.get_float32_matmul_precision() == "highest":
        return None
    name = torch.cuda.get_device_name(device).lower()
    table = PEAK_TFLOPS["fp32" if dtype == "fp32" else "bf16"]
    return next((peak for key, peak in table.items() if key.lower() in name), None)


def achieved(flops: float, seconds: float, peak: float | None, devices: int) -> tuple[float, float | None]:
    """(TFLOP/s per device, MFU): the step's model FLOPs over its wall `seconds`, shared by the `devices` that
    ran it, and that over the device's `peak` TFLOP/s (None without a peak). A zero time gives 0, as
    `StepStats.tokens_per_second` does."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    per_device = flops / seconds / devices / 1e12 if seconds > 0 else 0.0
    return per_device, (per_device / peak if peak is not None else None)


def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    s = np.asarray(lengths)
    if s.ndim != 1 or (s.size and (not np.issubdtype(s.dtype, np.integer) or s.min() < 1)):
        raise ValueError(f"lengths must be a flat sequence of ints >= 1, got {np.asarray(lengths).tolist()[:8]}")
    return s.astype(np.int64)
