"""What a profile records about the device it ran on."""

from __future__ import annotations

import torch


def test_a_cuda_profile_is_labelled_with_the_gpu_name(monkeypatch):
    from bytescale_compile.planner.profiler import device_label

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    assert device_label(torch.device("cuda:0")) == "cuda:0 (NVIDIA Test GPU)"
    assert device_label(torch.device("cpu")) == "cpu"
