"""Inductor code generation for the graphs our passes produce (`CompileConfig(codegen="inductor")`).

    Dynamo graph (after our passes) ──compile_fx──▶ AOTAutograd with Inductor's decompositions
        └─ joint graph ──Inductor's joint passes, then our partition hook──▶ forward + backward
              └─ compile_fx_inner per graph: elementwise work fused into generated kernels,
                 `bytescale::` ops (attention, fused loss, offload/reload) called as opaque extern kernels

Our partition hook runs as Inductor's `custom_partitioner_fn`, so the saved-activation table and the
offload pass see the graphs Inductor compiles. AOTAutograd's own cache is off for these graphs: a hit
there would skip the partition hook and leave the report without its table; Inductor's FX graph cache
(keyed by each partitioned graph and the hook's uuid) still serves the compiled code.

With the offload pass on, Inductor must not recycle buffers itself: `bytescale::offload_saved` keeps
the storage it is given (resident, or the part past the host prefix) until the backward, which
Inductor cannot see, so a buffer it thinks dead after the op and reuses for a later kernel would
overwrite a saved activation. Freed buffers go back to the allocator instead, which sees the
act_ctx's reference, as in eager mode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import fx
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from ..config import CompileConfig
from ..passes.report import GeneratedCode, GeneratedKernel, GraphReport

__all__ = ["compile_with_inductor"]

_PACKAGE = Path(__file__).resolve().parents[1]
_PARTITION_SOURCES = tuple(
    str(_PACKAGE / f) for f in ("capture/backend.py", "capture/saved.py", "passes/offload.py", "ops/offload.py")
)
_WRAPPER_DEF = re.compile(r"^[ \t]*def (?:call|partitioned_\w+)\(", re.M)
"""The wrapper's `call` and the functions of the layer bodies it calls (each compiled once, listed once)."""
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.", re.M)
_CALL = re.compile(r"^\s+(\w+)\(", re.M)
_EXTERN = re.compile(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\(", re.M)


class _Partitioner(CustomPartitionerFn):
    """Our partition hook as Inductor's custom partitioner; its uuid keys Inductor's FX graph cache."""

    def __init__(self, partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]], config: CompileConfig) -> None:
        self.partition = partition
        self.key = f"{get_hash_for_files(_PARTITION_SOURCES).hex()}:{config.partitioner}:{config.offload}"

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return self.key

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """Pickled (into Inductor's cache key, with the rest of its config) as the uuid: the hook is a closure."""
        return str, (self.key,)


def compile_with_inductor(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    config: CompileConfig,
    report: GraphReport,
    partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
) -> Callable:
    """`gm` compiled by Inductor, partitioned by `partition`; what Inductor generated goes to `report`."""
    patches = {"custom_partitioner_fn": _Partitioner(partition, config), "trace.provenance_tracking_level": 1}
    if config.offload != "off":
        patches |= {"allow_buffer_reuse": False, "inplace_buffers": False}
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = compile_fx(
            gm, example_inputs, inner_compile=_inner_compile(report, config.keep_graph_text), config_patches=patches
        )
    return cast(Callable, compiled)  # source text and weights come back only from AOTInductor


def _inner_compile(report: GraphReport, keep_text: bool) -> Callable:
    def inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        backward = bool(kwargs.get("is_backward"))
        graph = "backward" if backward else "inference" if kwargs.get("is_inference") else "forward"
        if keep_text:
            setattr(report, "backward_graph" if backward else "forward_graph", gm.print_readable(print_output=False))
        hits = counters["inductor"]["fxgraph_cache_hit"]
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        report.generated.append(_generated_code(graph, compiled, counters["inductor"]["fxgraph_cache_hit"] > hits))
        return compiled

    return inner


def _generated_code(graph: str, compiled: Any, cache_hit: bool) -> GeneratedCode:
    """Kernels and extern calls of `compiled`'s wrapper (layer bodies first), in call order; fused nodes from
    Inductor's provenance map."""
    source = getattr(compiled, "source_code", "") or ""
    first = _WRAPPER_DEF.search(source)
    body = source[first.start() :] if first else ""
    defined = set(_KERNEL_DEF.findall(source))
    fused = _fused_nodes(getattr(compiled, "inductor_provenance_mapping_str", None))
    kernels = [GeneratedKernel(name, fused.get(name, [])) for name in _CALL.findall(body) if name in defined]
    return GeneratedCode(graph, kernels, _EXTERN.findall(body), cache_hit)


def _fused_nodes(mapping: str | None) -> dict[str, list[str]]:
    """Kernel name -> post-grad nodes it computes; the map accumulates over a compilation, so per name the
    entry with the highest index (the latest kernel of that name) wins."""
    if not mapping:
        return {}
    latest: dict[str, tuple[int, list[str]]] = {}
    for key, table in json.loads(mapping).items():
        if not key.endswith("CodeToPost"):
            continue
        for kernel, nodes in table.items():
            name, _, index = kernel.rpartition(":")
            if index.isdigit() and int(index) >= latest.get(name, (-1, []))[0]:
                latest[name] = (int(index), nodes)
    return {name: nodes for name, (_, nodes) in latest.items()}
