"""Hybrid models: every token mixer accounted for, and none of them packed or sharded while left alone.

Convolutions (LFM2), Mamba/Mamba2 scans (Bamba, Jamba, Mamba2) and gated delta rules (Qwen3-Next) read
other tokens than their own. Until they have segment-aware ops, the compile report lists each one by
layer, a packed row is refused, and the runtime runs every sequence alone on one rank, which equals
single-process training.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import bytescale_compile as bsc
from bytescale_compile.planner import CostModel, PlanError, plan
from bytescale_compile.testing import run_distributed
from bytescale_compile.train.batch import BatchError
from tests.helpers import assert_matches_eager, eager_copy, protocol_batch, reference_step, rel_err
from tests.hf_models import HYBRID_BY_NAME, HYBRIDS, VOCAB, build_hybrid

NAMES = [h.name for h in HYBRIDS]
LENGTHS = [50, 9, 14, 30]
CAPACITY = 64


def _cheap_by_default(names: list[str]) -> list:
    """LFM2 compiles in seconds; the scans of the others take 25-40 s each, so they run with the slow set."""
    return [pytest.param(n, marks=[] if n == "lfm2" else pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _cheap_by_default(NAMES))
def test_every_token_mixer_is_found_by_layer_and_one_sequence_equals_eager(name):
    model = build_hybrid(name)
    optimized = bsc.optimize(model)
    # Qwen3-Next's gated delta rule runs in fp32 whatever the model's dtype; its A_log gradient, a sum of
    # cancelling terms 4000x below the largest gradient, holds their rounding (3e-8 of the largest)
    assert_matches_eager(optimized, eager_copy(model), protocol_batch([40], VOCAB, hf=True), floor_of_largest=1e-2)
    hybrid, report = HYBRID_BY_NAME[name], optimized.report
    assert sorted(r.source for r in report.rewrites("attention")) == list(hybrid.attention)
    assert sorted(report.token_mixers_left_alone()) == list(hybrid.mixers)
    table = report.mixer_layers()
    assert len(table) == len(hybrid.attention) + len(hybrid.mixers)
    for source in hybrid.mixers:
        line = next(line for line in table if f"`{source}`" in line)
        assert "left alone" in line and "over tokens" in line, line
    blockers = optimized.shard_blockers()
    assert [b for b in blockers if "token mixer" in b] == [
        b for b in blockers if any(f"`{source}`" in b for source in hybrid.mixers)
    ]
    assert len(blockers) == len(hybrid.mixers)


@pytest.mark.parametrize("name", _cheap_by_default(["lfm2", "mamba2"]))  # Mamba2: position_ids in **kwargs
def test_a_packed_row_is_refused_naming_the_layers(name):
    optimized = bsc.optimize(build_hybrid(name))
    optimized(**protocol_batch([16], VOCAB, hf=True))  # one sequence: fine
    with pytest.raises(bsc.ShardingError, match=HYBRID_BY_NAME[name].mixers[0].replace(".", r"\.")):
        optimized(**protocol_batch([9, 7], VOCAB, hf=True))  # the same length packed: no recompilation
    assert bsc.explain(optimized, **protocol_batch([9, 7], VOCAB, hf=True)).token_mixers_left_alone()


def test_a_sequence_longer_than_capacity_and_a_given_plan_that_packs_are_refused_before_any_step():
    model = build_hybrid("lfm2")
    before = copy.deepcopy(model.state_dict())
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY)
    with pytest.raises(PlanError, match=r"sequence 0 has 150 tokens.*capacity 64.*`model\.layers\.0\.conv`"):
        runtime.step([torch.randint(0, VOCAB, (n,)) for n in (150, 9)])
    packed = plan([9, 14], 1, CAPACITY, CostModel.preset("llama-7b"), strategy="balance")
    assert any(len(mb.sequences) > 1 for mb in packed.micro_batches)
    with pytest.raises(BatchError, match=r"one sequence per micro-batch.*`model\.layers\.0\.conv`"):
        runtime.step([torch.randint(0, VOCAB, (n,)) for n in (9, 14)], plan=packed)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


def _batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _step_worker(rank: int, world: int, name: str) -> None:
    model = build_hybrid(name)
    reference = copy.deepcopy(model)
    runtime = bsc.Runtime(model, torch.optim.SGD(model.parameters(), lr=0.5), capacity=CAPACITY)
    step_plan = runtime.plan(torch.tensor(LENGTHS).numpy())
    assert all(len(mb.ranks) == 1 and len(mb.sequences) == 1 for mb in step_plan.micro_batches), step_plan
    assert {mb.ranks[0] for mb in step_plan.micro_batches} == set(range(world))
    stats = runtime.step(_batch())
    ref_loss, ref_params = reference_step(reference, _batch(), lr=0.5, hf=True)
    assert rel_err(torch.tensor(stats.loss), torch.tensor(ref_loss)) <= 1e-5, (stats.loss, ref_loss)
    params = dict(model.named_parameters())
    worst = max(ref_params, key=lambda n: rel_err(params[n], ref_params[n]))
    assert rel_err(params[worst], ref_params[worst]) <= 1e-5, f"rank {rank}: {worst}"


@pytest.mark.parametrize("name", _cheap_by_default(NAMES))
def test_two_rank_step_runs_each_sequence_alone_and_equals_one_process(name):
    run_distributed(_step_worker, 2, name)


class _ConvMixer(nn.Module):
    """Token-local work around one mixer of each kind the analysis must find, in plain torch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=2, groups=16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, position_ids, shift_labels, num_items_in_batch):
        x = self.embed(input_ids)
        if self.kind == "conv":
            x = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        elif self.kind == "cumsum":
            x = x.cumsum(dim=1)
        elif self.kind == "mean":
            x = x - x.mean(dim=1, keepdim=True)
        elif self.kind == "shift":
            x = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1] + x
        logits = self.head(torch.relu(x)).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), reduction="sum")
        return SimpleNamespace(loss=loss / num_items_in_batch)


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("conv", "convolution over tokens (kernel 3)"),
        ("cumsum", "cumulative op over tokens"),
        ("mean", "reduction over tokens"),
        ("shift", "shift along tokens (pad in front)"),
        ("local", None),
    ],
)
def test_the_analysis_finds_each_kind_of_mixer_and_not_the_loss(kind, pattern):
    optimized = bsc.optimize(_ConvMixer(kind))
    optimized(**protocol_batch([16], VOCAB))
    found = [s.reason for s in optimized.report.skipped("token_mixers")]
    if pattern is None:
        assert found == [] and optimized.shard_blockers() == []
    else:
        assert len(found) == 1 and found[0].startswith(pattern), found
