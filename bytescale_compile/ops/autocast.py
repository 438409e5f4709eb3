"""Autocast rules of the custom ops: cast to the autocast dtype, then run with autocast off.

Under `torch.autocast` the inputs of an op arrive in mixed dtypes (the projections run in bf16, RoPE
multiplies by fp32 tables and promotes q and k back to fp32, v stays bf16). Like SDPA and linear,
the ops then run in the autocast dtype. `torch.library.register_autocast` fixes that dtype when it
is registered; these rules read it at every call (`torch.get_autocast_dtype`), so bf16 and fp16
autocast both work, on the CPU and on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._library.custom_ops import CustomOpDef

__all__ = ["AUTOCAST_DEVICES", "register_autocast_rule", "to_autocast_dtype"]

AUTOCAST_DEVICES = ("cpu", "cuda")

CastArgs = Callable[[torch.dtype, tuple[Any, ...]], tuple[Any, ...]]
"""`(autocast dtype, positional args) -> args the op runs on`."""

_LIB = torch.library.Library("bytescale", "FRAGMENT")


def to_autocast_dtype(x: Any, dtype: torch.dtype) -> Any:
    """A floating tensor in `dtype`; anything else (integer tensors, None, numbers) unchanged."""
    return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x


def register_autocast_rule(op: CustomOpDef, cast: CastArgs) -> None:
    """Run `op` under autocast (every device type of `AUTOCAST_DEVICES`) on `cast(dtype, args)`."""
    for device_type in AUTOCAST_DEVICES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        _LIB.impl(op._name, _autocast_kernel(op, cast, device_type, key), key, with_keyset=True)


def _autocast_kernel(op: CustomOpDef, cast: CastArgs, device_type: str, key: str) -> Callable[..., Any]:
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(_keyset: Any, *args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op._opoverload(*cast(torch.get_autocast_dtype(device_type), args), **kwargs)

    return kernel
