"""Whether Triton kernels run on the GPU or in Triton's interpreter (CPU tensors, for tests)."""

from __future__ import annotations

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["built_for_interpreter"]


def built_for_interpreter(*kernels: object) -> bool:
    """True when `kernels` and Triton's own jit helpers (`tl.zeros`, `tl.sum`, ...) run in the interpreter.

    Triton picks GPU or interpreter per `@triton.jit`, when the function is decorated, from
    TRITON_INTERPRET. Its helpers are decorated when triton is first imported, which torch does early
    (`torch._dynamo`), so the variable must be set when the process starts: set later, it gives
    kernels that the interpreter cannot run.
    """
    return all(isinstance(k, InterpretedFunction) for k in (tl.zeros, *kernels))
