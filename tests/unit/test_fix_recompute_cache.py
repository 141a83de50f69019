"""``recompute-cache-collective`` on CPU without a process group: a stand-in collective wrapped by the
fix runs once in a non-reentrant checkpointed region's forward and is replayed, not called, in the
recompute; outside a region it always runs; a recompute whose input differs from the forward's raises
and fails the check instead of replaying a stale result."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moedoctor.fixes.recompute_cache_collective import CHECK, TARGET, _Cache
from moedoctor.fixes.runtime import TargetState


class _Runtime:
    checks_enabled = True

    def __init__(self) -> None:
        self.checks: list[tuple[str, bool | None, str]] = []
        self.notes: list[str] = []

    def check(self, name, passed, detail="", worst=None):
        self.checks.append((name, passed, detail))

    def write(self):
        pass

    def note(self, message):
        self.notes.append(message)

    def at_finish(self, callback):
        pass


def _setup():
    runtime = _Runtime()
    cache = _Cache(runtime, TargetState(TARGET, ""))
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):  # the stand-in: "the others" add 10
        calls.append(tensor.clone())
        tensor.add_(10)

    return runtime, cache.__class__._wrap_c10d(cache, "all_reduce", all_reduce), calls


def test_the_recompute_replays_the_forwards_result_without_calling_the_collective():
    runtime, all_reduce, calls = _setup()
    w = torch.ones(3, requires_grad=True)

    def region(x):
        n = torch.tensor([x.shape[0]])
        all_reduce(n)
        return x * w * n

    x = torch.arange(3.0, requires_grad=True)
    y = checkpoint(region, x, use_reentrant=False)
    assert len(calls) == 1 and y.tolist() == [0.0, 13.0, 26.0]
    y.sum().backward()
    assert len(calls) == 1, "the recompute issued the collective again"
    assert w.grad.tolist() == [0.0, 13.0, 26.0] and x.grad.tolist() == [13.0] * 3
    assert runtime.checks and runtime.checks[-1][:2] == (CHECK, True)


def test_outside_a_checkpointed_region_the_collective_always_runs():
    _, all_reduce, calls = _setup()
    n = torch.tensor([1])
    all_reduce(n)
    all_reduce(n)
    assert len(calls) == 2 and n.item() == 21


def test_a_recompute_with_another_input_raises_instead_of_replaying():
    runtime, all_reduce, calls = _setup()
    state = {"offset": 0}
    w = torch.ones(2, requires_grad=True)

    def region(x):
        n = torch.tensor([x.shape[0] + state["offset"]])  # state the forward changes: not replayable
        all_reduce(n)
        return x * w * n

    y = checkpoint(region, torch.ones(2, requires_grad=True), use_reentrant=False)
    state["offset"] = 1
    with pytest.raises(RuntimeError, match="differs from the forward's"):
        y.sum().backward()
    assert len(calls) == 1
    assert runtime.checks[-1][0] == CHECK and runtime.checks[-1][1] is False
