"""Custom ops in the `bytescale::` namespace; importing this package registers them."""

from . import attention, loss, mixers

__all__ = ["KERNEL_OPS", "attention", "loss", "mixers"]

KERNEL_OPS = ("bytescale::attention", "bytescale::fused_linear_cross_entropy")
"""Our ops whose kernels `kernels.dispatch` chooses per device (Triton or the torch reference): what the compile
report names the choice of."""
