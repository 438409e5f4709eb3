"""Host-to-device copies that never make the host wait."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A host tensor bound for CUDA is pinned and copied without blocking: the copy queues behind
    the work already issued, where a pageable one makes the host wait for the device. The pinned buffer is the
    caching host allocator's, kept until the copy is done. The copy runs on the current stream: a tensor cached
    for reuse must be first used there, or its users must wait on that stream."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
