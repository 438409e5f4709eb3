"""Custom ops in the `bytescale::` namespace; importing this package registers them."""

from . import attention, loss, mixers, tensor_parallel

__all__ = ["KERNEL_OPS", "REFERENCE_OPS", "attention", "loss", "mixers", "tensor_parallel"]

KERNEL_OPS = ("bytescale::attention", "bytescale::fused_linear_cross_entropy")
"""Our ops whose kernels `kernels.dispatch` chooses per call (attention from its backend table, the loss Triton or
the torch reference): what the compile report names the choice of."""

REFERENCE_OPS = ("bytescale::vocab_parallel_linear_cross_entropy",)
"""Our ops that run their torch reference on every device (no Triton kernel): the compile report says "reference"."""
