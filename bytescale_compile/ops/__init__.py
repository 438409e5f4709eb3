"""Custom ops in the `bytescale::` namespace; importing this package registers them."""

from . import attention, loss

__all__ = ["attention", "loss"]
