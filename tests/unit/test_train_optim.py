"""The optimizer step on one process: torch's fused AdamW (the distributed optimizer's fragments and
`build_optimizer`'s parameters) against the foreach AdamW it replaced, clipping and the skip on a non-finite
gradient or loss handed to the kernel as device tensors (`StepGuard`) with no read on the host, and the distributed
optimizer's state dict, step counters on the CPU as checkpoints hold them.

The fused kernel and the foreach one round differently: updated weights agree to a few fp32 ulps, hence
`rtol=ULPS * eps` with an absolute floor for elements near zero."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from bytescale_compile.engine.dist_optim import DistributedOptimizer
from bytescale_compile.engine.optim import StepGuard, build_optimizer, guarded_step, param_groups
from bytescale_compile.train.checkpoint import load_checkpoint, save_checkpoint

LR, BETAS, DECAY = 1e-2, (0.9, 0.95), 0.1
MAX_NORM = 0.5  # below the gradients' norm: clipping acts
STEPS = 3
ULPS = 8
RTOL = ULPS * torch.finfo(torch.float32).eps
ATOL = 1e-7  # weights are O(0.1-1): a few ulps of that scale


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 5, bias=False)).to(device)


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    """In the weights' dtype and device (bf16 with the distributed optimizer's default), summed in fp32."""
    weight = next(model.parameters())
    return model(_inputs(step).to(weight.device, weight.dtype)).float().pow(2).sum()


def _foreach(model: nn.Module) -> torch.optim.AdamW:
    """The optimizer the fused one replaced: torch's foreach AdamW over the same groups."""
    return torch.optim.AdamW(param_groups(model, DECAY), lr=LR, betas=BETAS, foreach=True)


def _reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, max_norm: float | None) -> None:
    """Backward, explicit clipping (`clip_grad_norm_`), step."""
    optimizer.zero_grad()
    _loss(model, step).backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


def _sharded_step(model: nn.Module, optimizer: DistributedOptimizer, step: int, max_norm: float | None) -> None:
    """Backward into the gradient buffer, then the norm and the guarded fused step, as the Runtime takes it."""
    optimizer.start(1)
    _loss(model, step).backward()
    optimizer.finish()
    optimizer.step(StepGuard.of(optimizer.grad_norm(), max_norm))


def _assert_near(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


def _copy_grads(src: nn.Module, dst: nn.Module) -> None:
    for p, q in zip(src.parameters(), dst.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_equals_the_foreach_step_on_the_same_gradients(device):
    model, reference = _model(device), _model(device)
    fused, foreach = build_optimizer(model, LR, DECAY, BETAS), _foreach(reference)
    assert all(g["fused"] for g in fused.param_groups)
    for step in range(STEPS):
        fused.zero_grad()
        _loss(model, step).backward()
        _copy_grads(model, reference)  # the very same gradients
        fused.step()
        foreach.step()
        _assert_near(model, reference)
    assert all(s["step"].device == p.device and s["step"].dtype == torch.float32 for p, s in fused.state.items())


@pytest.mark.parametrize("device", DEVICES)
def test_distributed_optimizer_fused_step_equals_the_foreach_step(device):
    model, reference = _model(device), _model(device)
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS, dtype=torch.float32)
    assert optimizer.inner.defaults["fused"]
    foreach = _foreach(reference)
    for step in range(STEPS):
        _sharded_step(model, optimizer, step, None)
        _reference_step(reference, foreach, step, None)
        _assert_near(model, reference)


@pytest.mark.parametrize("max_norm", [MAX_NORM, 1e3])  # clipped, and a bound above the norm (divisor 1)
def test_clipping_through_grad_scale_equals_explicit_clipping(max_norm):
    model, reference = _model(), _model()
    fused, foreach = build_optimizer(model, LR, DECAY, BETAS), _foreach(reference)
    sharded_model = _model()
    sharded = DistributedOptimizer(sharded_model, LR, DECAY, BETAS, dtype=torch.float32)
    for step in range(STEPS):
        fused.zero_grad()
        _loss(model, step).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        guard = StepGuard.of(norm, max_norm)
        guarded_step(fused, guard, list(model.parameters()))
        _reference_step(reference, foreach, step, max_norm)
        _sharded_step(sharded_model, sharded, step, max_norm)
        assert (float(norm) > max_norm) == (max_norm == MAX_NORM)
        _assert_near(model, reference)
        _assert_near(sharded_model, reference)


def test_distributed_optimizer_norm_is_the_model_gradients_norm():
    model, reference = _model(), _model()
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS, dtype=torch.float32)
    optimizer.start(1)
    _loss(model, 0).backward()
    optimizer.finish()
    _loss(reference, 0).backward()
    norm = optimizer.grad_norm()
    expected = torch.nn.utils.get_total_norm([p.grad.double() for p in reference.parameters()])
    assert norm.dtype == torch.float32 and norm.dim() == 0
    torch.testing.assert_close(norm.double(), expected, rtol=RTOL, atol=0.0)
    assert len(optimizer._weight_runs[0]) == 1  # one rank: the bf16 refresh is one copy of the whole buffer


class _NoHostReads(TorchFunctionMode):
    """Fails any read of a tensor's value on the host (what would sync a device) while active."""

    _READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._READS:
            raise AssertionError(f"{func.__name__} read a tensor on the host during the step")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _cuda_sync_errors(device: str) -> Iterator[None]:
    """On CUDA, any synchronising call raises (what `_NoHostReads` cannot see: copies to the host)."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for state in optimizer.state.values() for t in state.values()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cause", ["gradient", "loss"])
def test_a_non_finite_step_is_skipped_without_a_host_read(cause, device):
    model = _model(device)
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS)
    plain = _model(device)
    fused = build_optimizer(plain, LR, DECAY, BETAS)
    _sharded_step(model, optimizer, 0, MAX_NORM)  # a real first step: moments and counters not zero
    one = torch.ones((), device=device)
    guarded_step(fused, StepGuard.of(one, MAX_NORM), [])  # no gradients yet: nothing to update
    _loss(plain, 0).backward()
    guarded_step(fused, StepGuard.of(one, MAX_NORM), list(plain.parameters()))
    weights = [p.detach().clone() for p in model.parameters()] + [p.detach().clone() for p in plain.parameters()]
    before = _state(optimizer.inner) + [optimizer.main.clone()] + _state(fused)

    optimizer.start(1)
    _loss(model, 1).backward()
    optimizer.finish()
    fused.zero_grad()
    _loss(plain, 1).backward()
    if cause == "gradient":
        optimizer.grads.data[0] = float("nan")
        next(plain.parameters()).grad[0, 0] = float("inf")
    bad_loss = torch.tensor(1.0 if cause == "loss" else 0.0, device=device)
    with _NoHostReads(), _cuda_sync_errors(device):
        sharded_guard = StepGuard.of(optimizer.grad_norm(), MAX_NORM, bad_loss=bad_loss)
        optimizer.step(sharded_guard)
        plain_norm = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
        plain_guard = StepGuard.of(plain_norm, MAX_NORM, bad_loss=bad_loss)
        guarded_step(fused, plain_guard, list(plain.parameters()))

    assert bool(sharded_guard.skip) and bool(plain_guard.skip)
    assert bool(torch.isfinite(sharded_guard.norm)) == (cause == "loss")  # a NaN norm is reported
    after = [p.detach() for p in model.parameters()] + [p.detach() for p in plain.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, weights))
    now = _state(optimizer.inner) + [optimizer.main] + _state(fused)
    assert all(torch.equal(a, b) for a, b in zip(now, before))  # moments, main weights and step counters
    assert {float(s["step"]) for s in optimizer.inner.state.values()} == {1.0}


def _load_into(optimizer: DistributedOptimizer, state: dict) -> None:
    """What DCP does on a load: the saved values read into `optimizer.state_dict()`'s tensors, in place; then the
    optimizer takes them over."""
    target = optimizer.state_dict()
    for part in ("model", "optim"):
        for key, value in state[part].items():
            if isinstance(value, torch.Tensor) and not key.endswith(".step"):
                target[part][key].copy_(value)
            else:
                target[part][key] = value
    optimizer.load_state_dict(target)


def test_state_dict_round_trips_with_cpu_step_counters():
    model = _model()
    optimizer = DistributedOptimizer(model, LR, DECAY, BETAS)
    for step in range(2):
        _sharded_step(model, optimizer, step, MAX_NORM)
    saved = optimizer.state_dict()
    steps = {k: v for k, v in saved["optim"].items() if k.endswith(".step")}
    assert steps and all(
        v.device.type == "cpu" and v.dtype == torch.float32 and float(v) == 2.0 for v in steps.values()
    )
    saved = copy.deepcopy({part: dict(values) for part, values in saved.items()})
    # as the foreach optimizer saved them: fp64-able CPU counters, `fused` None in the groups
    saved["optim"] = {k: v.double() if k.endswith(".step") else v for k, v in saved["optim"].items()}
    saved["optim"].update({k: None for k in saved["optim"] if k.endswith(".fused")})

    resumed_model = _model()
    resumed = DistributedOptimizer(resumed_model, LR, DECAY, BETAS)
    _load_into(resumed, saved)
    assert all(g["fused"] for g in resumed.inner.param_groups)
    for state in resumed.inner.state.values():
        assert state["step"].device == resumed.main.device and state["step"].dtype == torch.float32
    assert len({id(s["step"]) for s in resumed.inner.state.values()}) == len(resumed.inner.state)  # not shared
    assert torch.equal(resumed.main, optimizer.main) and torch.equal(resumed.weights, optimizer.weights)
    for step in range(2, 4):
        _sharded_step(model, optimizer, step, MAX_NORM)
        _sharded_step(resumed_model, resumed, step, MAX_NORM)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))
    assert torch.equal(resumed.main, optimizer.main)


def test_fused_torch_optimizer_resumes_a_checkpoint_of_the_foreach_one(tmp_path):
    """A checkpoint of the foreach AdamW (CPU step counters, `fused` None in its groups) loads into the fused one,
    which stays fused and continues as the foreach one does."""
    model, reference = _model(), _model()
    old = _foreach(model)
    for step in range(2):
        _reference_step(model, old, step, None)
    assert all(s["step"].device.type == "cpu" for s in old.state.values())
    path = save_checkpoint(tmp_path, 2, model, old, {"step": 2})
    resumed_model = _model()
    fused = build_optimizer(resumed_model, LR, DECAY, BETAS)
    load_checkpoint(path, resumed_model, fused)
    load_checkpoint(path, reference, foreach := _foreach(reference))
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    for p, state in fused.state.items():
        assert state["step"].device == p.device and state["step"].dtype == torch.float32 and float(state["step"]) == 2
    for step in range(2, 4):
        _reference_step(resumed_model, fused, step, None)
        _reference_step(reference, foreach, step, None)
        _assert_near(resumed_model, reference)


@pytest.mark.parametrize("grad_reduce_dtype", [torch.float32, torch.bfloat16])
def test_bf16_weights_get_the_distributed_optimizer(grad_reduce_dtype):
    """`build_optimizer` chooses the optimizer from the weights' dtype: for bf16 the distributed optimizer, whose
    steps equal one built directly, bit for bit."""
    model, reference = _model(), _model()
    built = build_optimizer(model, LR, DECAY, BETAS, dtype=torch.bfloat16, grad_reduce_dtype=grad_reduce_dtype)
    direct = DistributedOptimizer(reference, LR, DECAY, BETAS, grad_reduce_dtype=grad_reduce_dtype)
    assert isinstance(built, DistributedOptimizer)
    for step in range(STEPS):
        _sharded_step(model, built, step, MAX_NORM)
        _sharded_step(reference, direct, step, MAX_NORM)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.dtype == torch.bfloat16 and torch.equal(p, q), name


def test_weights_no_optimizer_trains_are_refused():
    with pytest.raises(ValueError, match="always shards: drop zero"):
        build_optimizer(_model(), LR, DECAY, BETAS, zero=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not torch.float16"):
        build_optimizer(_model(), LR, DECAY, BETAS, dtype=torch.float16)
