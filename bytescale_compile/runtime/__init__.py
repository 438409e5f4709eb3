"""What runs the compiled graphs: the micro-batch context the custom ops read, the zigzag layouts, and the
P2P (`p2p`) that ring attention, Ulysses and the distributed mixers move their tensors through."""

from ..lazy import alias_moved_modules

# `dist_attn`, split into `p2p` and `ring_attention`, still imports for one release: as `ring_attention`,
# which also resolves the names that moved to `p2p`.
alias_moved_modules({f"{__name__}.dist_attn": f"{__name__}.ring_attention"})
