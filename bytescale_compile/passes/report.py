"""What the compiler did, in a form a user can read (`to_markdown`) or a tool can consume (`to_dict`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "Rewrite",
    "Skipped",
    "PassResult",
    "SavedActivation",
    "GeneratedKernel",
    "GeneratedCode",
    "GraphReport",
    "CompileReport",
    "ATTENTION_PASS",
    "TOKEN_MIXERS_PASS",
    "OPAQUE_PASS",
]

ATTENTION_PASS = "attention"
TOKEN_MIXERS_PASS = "token_mixers"
OPAQUE_PASS = "opaque_regions"
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Rewrite:
    """One matched pattern and what it became."""

    node: str
    target: str
    source: str
    detail: str = ""
    boundary_bytes: int = 0
    """Bytes the new op moves per chunk boundary when a sequence is shared by ranks, whatever its length: a
    convolution's halo or a scan's state summary (0 for attention, whose K/V bytes grow with the tokens)."""


@dataclass(frozen=True)
class Skipped:
    """A pattern a pass recognised but left alone, with the reason."""

    node: str
    target: str
    source: str
    reason: str


@dataclass
class PassResult:
    name: str
    rewrites: list[Rewrite] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    disabled: str | None = None
    """Why the pass did not run (switched off in CompileConfig), or None when it ran."""
    counts: dict[str, int] = field(default_factory=dict)
    """The rewrites counted by what they do, where "N rewritten" would mislead (empty otherwise): the offload pass
    routes resident storages through its ops too, so it counts what it offloads and what stays apart."""


@dataclass(frozen=True)
class SavedActivation:
    """A forward tensor the backward graph needs: what offloading would move."""

    name: str
    shape: str
    dtype: str
    bytes_per_token: int | None
    """Bytes per token of the token dimension; None when the size grows with T² ([.., T, T] scores)."""
    layer: int | None
    """Transformer layer: its producer's, or after the offload pass the one whose backward reads it back."""
    source: str
    decision: str
    alias_of: str | None = None
    """Name of an earlier saved tensor sharing this one's storage: no memory of its own."""


@dataclass(frozen=True)
class GeneratedKernel:
    """One kernel Inductor generated, with the graph nodes fused into it."""

    name: str
    fused_nodes: list[str]


@dataclass
class GeneratedCode:
    """What Inductor made of one partitioned graph (`CompileConfig(codegen="inductor")`)."""

    graph: str
    """"forward", "backward" or "inference"."""
    kernels: list[GeneratedKernel]
    extern_calls: list[str]
    """Ops called as they are (our `bytescale::` ops, matmuls): one per call site."""
    cache_hit: bool
    """Taken from Inductor's FX graph cache rather than generated now."""


@dataclass
class GraphReport:
    """One captured graph (a graph break gives several per call)."""

    graph_id: int
    passes: list[PassResult] = field(default_factory=list)
    saved_activations: list[SavedActivation] = field(default_factory=list)
    saved_activations_note: str = ""
    """Why the table is empty although the graph has a backward, when it is."""
    graph_before: str = ""
    graph_after: str = ""
    forward_graph: str = ""
    backward_graph: str = ""
    generated: list[GeneratedCode] = field(default_factory=list)
    """Inductor's code for the partitioned graphs; empty with `CompileConfig(codegen="none")`."""
    kernels: dict[str, str] = field(default_factory=dict)
    """Our op in the graph -> the kernels `kernels.dispatch` chose when it was compiled: "triton" or "reference"
    for the loss (on the device of the graph's example inputs); for `bytescale::attention` the backend of its
    table ("torch-flash", "triton", "reference") for the graph's q/k/v as packed segments (ring blocks choose
    per block when they run), several joined by ", " when the graph's attention layers differ."""
    kernel_notes: dict[str, str] = field(default_factory=dict)
    """Our op -> why the backends the table prefers to the chosen one were passed over, e.g.
    "torch-flash: has no soft-cap" (attention only)."""


@dataclass
class CompileReport:
    """The report of the latest compilation: every graph compiled by that call."""

    graphs: list[GraphReport] = field(default_factory=list)
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    """Module path -> the tensor-parallel layout the compiler saw there (empty without TP)."""
    graph_breaks: list[str] = field(default_factory=list)
    """Why Dynamo broke the training forward's graph or skipped a frame (the first line of each reason): the code
    between graphs runs eagerly (what it calls is compiled again, except under a function Dynamo never traces)."""
    outside_graphs: list[str] = field(default_factory=list)
    """Parts of the model known to hold attention or mixers that ran outside every compiled graph, e.g. checkpointed
    layers whose caller Dynamo gave up on (torch's checkpoint then runs them eagerly)."""

    @property
    def kernels(self) -> dict[str, str]:
        """Our op -> its kernels over every graph (`GraphReport.kernels`)."""
        return {op: impl for g in self.graphs for op, impl in g.kernels.items()}

    @property
    def kernel_notes(self) -> dict[str, str]:
        """Our op -> why preferred backends were passed over, over every graph (`GraphReport.kernel_notes`)."""
        return {op: note for g in self.graphs for op, note in g.kernel_notes.items()}

    def pass_results(self, name: str) -> list[PassResult]:
        return [p for g in self.graphs for p in g.passes if p.name == name]

    def rewrites(self, name: str) -> list[Rewrite]:
        return [r for p in self.pass_results(name) for r in p.rewrites]

    def skipped(self, name: str) -> list[Skipped]:
        return [s for p in self.pass_results(name) for s in p.skipped]

    @property
    def saved_activations(self) -> list[SavedActivation]:
        return [a for g in self.graphs for a in g.saved_activations]

    def activation_bytes_per_token(
        self, share: Callable[[SavedActivation], float] | None = None
    ) -> tuple[dict[int, float], float]:
        """(layer index -> bytes per token of the activations saved in that layer, bytes per token of those outside
        any layer): the saved-activation table summed, an alias counted once (with the tensor it aliases).
        `share(a)` scales each tensor (tensor parallelism keeps a share of some). Tensors whose size grows with T²
        (bytes_per_token None) have no per-token figure and are left out of both sums: a caller that needs the
        whole memory checks `saved_activations` for them (`train/memory.py` refuses such a model)."""
        layers: dict[int, float] = {}
        outside = 0.0
        for a in self.saved_activations:
            if a.alias_of is not None or a.bytes_per_token is None:
                continue
            size = a.bytes_per_token * (share(a) if share is not None else 1)
            if a.layer is None:
                outside += size
            else:
                layers[a.layer] = layers.get(a.layer, 0) + size
        return layers, outside

    def mixer_layers(self) -> list[str]:
        """The token-mixer table, one line per module that mixes tokens, in layer order:
        "layer 3 (`model.layers.3.self_attn`): sliding window 4096, rewritten", or
        "layer 0 (`model.layers.0.conv`): left alone: convolution over tokens (kernel 3)"."""
        sites = [(r.source, f"{r.detail or 'causal'}, rewritten") for r in self.rewrites(ATTENTION_PASS)]
        sites += [(source, f"{', '.join(patterns)}, rewritten") for source, patterns in self.mixers_rewritten().items()]
        sites += [(s.source, f"left alone: {s.reason}") for s in self.skipped(ATTENTION_PASS)]
        sites += [
            (source, f"left alone: {', '.join(patterns)}")
            for source, patterns in self.token_mixers_left_alone().items()
        ]
        sites += [(s.source, f"left alone: {s.reason}") for s in self.skipped(OPAQUE_PASS)]
        return [
            f"{_layer_name(source)}: {what}" for source, what in sorted(sites, key=lambda site: _layer_key(site[0]))
        ]

    def shard_blockers(self) -> list[str]:
        """Why sequences of this model cannot be sharded over ranks or packed into one row; empty when they can.

        Both are safe only when every token mixer found in the compiled graphs became a segment-aware op
        (`bytescale::attention`): any other would read across the packed sequences, or only the rank's own
        zigzag chunks of its sequence — silently wrong. So would one inside a region the passes do not look
        into (`passes/opaque.py`).
        """
        if not self.graphs:
            return ["the model has not been compiled yet (no compile report)"]
        blockers = [f"attention pass disabled ({p.disabled})" for p in self.pass_results(ATTENTION_PASS) if p.disabled]
        blockers += [
            f"`{s.source}` (`{s.node}`): attention left alone: {s.reason}" for s in self.skipped(ATTENTION_PASS)
        ]
        blockers += [
            f"`{source}`: token mixer left alone ({', '.join(patterns)}): it would read across packed "
            f"sequences, and only a rank's own chunks of a shared one"
            for source, patterns in self.token_mixers_left_alone().items()
        ]
        blockers += [f"`{s.source}`: {s.reason}" for s in self.skipped(OPAQUE_PASS)]
        blockers += self.outside_graphs
        return list(dict.fromkeys(blockers))

    def mixers_rewritten(self) -> dict[str, list[str]]:
        """Module path -> what each segment-aware convolution or scan there computes (`bytescale::causal_conv1d`,
        `bytescale::scan`)."""
        found: dict[str, list[str]] = {}
        for r in self.rewrites(TOKEN_MIXERS_PASS):
            if r.detail not in found.setdefault(r.source, []):
                found[r.source].append(r.detail)
        return found

    def mixer_costs(self) -> tuple[int, int]:
        """(layers whose mixers are segment-aware convolutions or scans, bytes one chunk boundary of a shared
        sequence moves over all of them): what the cost model charges for them instead of K/V."""
        layers = {_layer_key(r.source)[0] for r in self.rewrites(TOKEN_MIXERS_PASS)}
        per_call = {(r.source, r.detail): r.boundary_bytes for r in self.rewrites(TOKEN_MIXERS_PASS)}
        return len(layers), sum(per_call.values())

    def _reasons_by_module(self, pass_name: str) -> dict[str, list[str]]:
        """Module path -> the distinct reasons `pass_name` left something alone there."""
        found: dict[str, list[str]] = {}
        for s in self.skipped(pass_name):
            if s.reason not in found.setdefault(s.source, []):
                found[s.source].append(s.reason)
        return found

    def token_mixers_left_alone(self) -> dict[str, list[str]]:
        """Module path -> what each token mixer the analysis left alone there does."""
        return self._reasons_by_module(TOKEN_MIXERS_PASS)

    def opaque_regions(self) -> dict[str, list[str]]:
        """Module path -> what hides there inside a region the passes did not look into (`passes/opaque.py`)."""
        return self._reasons_by_module(OPAQUE_PASS)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kernels": self.kernels, "kernel_notes": self.kernel_notes}

    def to_markdown(self, graphs: bool = False) -> str:
        """Human-readable report; `graphs=True` appends the graphs before/after as text."""
        lines = [f"# bytescale_compile report ({len(self.graphs)} graph(s))", ""]
        if self.kernels:
            notes = self.kernel_notes
            kernels = [
                f"`{op}` {impl}" + (f" ({notes[op]})" if op in notes else "")
                for op, impl in sorted(self.kernels.items())
            ]
            lines += ["Kernels: " + ", ".join(kernels), ""]
        if self.tensor_parallel:
            lines += ["## Tensor parallelism per layer", ""]
            lines += [
                f"- {_layer_name(path)}: {what}"
                for path, what in sorted(self.tensor_parallel.items(), key=lambda i: _layer_key(i[0]))
            ]
            lines.append("")
        layers = self.mixer_layers()
        if layers:
            lines += ["## Token mixers per layer", ""] + [f"- {line}" for line in layers] + [""]
        if self.graph_breaks or self.outside_graphs:
            lines += ["## Outside the compiled graphs", ""]
            lines += [f"- {what}" for what in self.outside_graphs]
            lines += [f"- graph break: {reason}" for reason in self.graph_breaks] + [""]
        for g in self.graphs:
            lines += [f"## Graph {g.graph_id}", ""]
            for p in g.passes:
                lines += _pass_markdown(p)
            lines += _saved_markdown(g.saved_activations)
            if g.saved_activations_note:
                lines += [f"### Saved activations: not listed ({g.saved_activations_note})", ""]
            lines += _generated_markdown(g.generated)
            if graphs:
                for title, text in (
                    ("before passes", g.graph_before),
                    ("after passes", g.graph_after),
                    ("forward (partitioned)", g.forward_graph),
                    ("backward (partitioned)", g.backward_graph),
                ):
                    lines += [f"### Graph {title}", "", "```", text.rstrip(), "```", ""]
        return "\n".join(lines)


def _pass_markdown(p: PassResult) -> list[str]:
    if p.disabled:
        return [f"### Pass `{p.name}`: disabled ({p.disabled})", ""]
    done = ", ".join(f"{n} {what}" for what, n in p.counts.items()) if p.counts else f"{len(p.rewrites)} rewritten"
    lines = [f"### Pass `{p.name}`: {done}, {len(p.skipped)} left alone", ""]
    if p.rewrites:
        lines += ["| node | source | became | detail |", "|---|---|---|---|"]
        lines += [f"| `{r.node}` | `{r.source}` | `{r.target}` | {r.detail} |" for r in p.rewrites]
        lines.append("")
    if p.skipped:
        lines += ["| node | source | target | left alone because |", "|---|---|---|---|"]
        lines += [f"| `{s.node}` | `{s.source}` | `{s.target}` | {s.reason} |" for s in p.skipped]
        lines.append("")
    return lines


def _saved_markdown(saved: list[SavedActivation]) -> list[str]:
    if not saved:
        return []
    per_token = sum(a.bytes_per_token or 0 for a in saved if a.alias_of is None)
    lines = [
        f"### Saved activations: {len(saved)} tensors, {per_token} bytes per token (aliases counted once)",
        "",
        "| tensor | shape | dtype | bytes/token | layer | source | decision |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| `{a.name}` | {a.shape} | {a.dtype} | {a.bytes_per_token if a.bytes_per_token is not None else 'T²'}{f' (alias of `{a.alias_of}`)' if a.alias_of else ''} | "
        f"{a.layer if a.layer is not None else '-'} | `{a.source}` | {a.decision} |"
        for a in saved
    ]
    lines.append("")
    return lines


def _generated_markdown(generated: list[GeneratedCode]) -> list[str]:
    lines = []
    for code in generated:
        fused = sum(len(k.fused_nodes) for k in code.kernels)
        lines += [
            f"### Inductor, {code.graph} graph: {len(code.kernels)} kernels fusing {fused} nodes, "
            f"{len(code.extern_calls)} extern calls{' (FX graph cache hit)' if code.cache_hit else ''}",
            "",
        ]
        if code.kernels:
            lines += ["| kernel | fused nodes |", "|---|---|"]
            lines += [f"| `{k.name}` | {len(k.fused_nodes)}: {', '.join(k.fused_nodes)} |" for k in code.kernels]
            lines.append("")
        if code.extern_calls:
            counts = {name: code.extern_calls.count(name) for name in code.extern_calls}
            lines += ["Extern calls: " + ", ".join(f"`{name}` ×{n}" for name, n in counts.items()), ""]
    return lines


def _layer_key(source: str) -> tuple[int, str]:
    m = _LAYER.search(source)
    return (int(m.group(1)) if m else -1, source)


def _layer_name(source: str) -> str:
    m = _LAYER.search(source)
    return f"layer {m.group(1)} (`{source}`)" if m else f"`{source}`"
