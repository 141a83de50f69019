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


def _gather_stand_in(calls, list_form: bool = False):
    """A 2-rank all-gather that gives (x, x + 1): the tensor form, or the list form of dist.all_gather."""

    def all_gather(out, tensor, group=None, async_op=False):
        calls.append(tensor.clone())
        if list_form:
            out[0].copy_(tensor)
            out[1].copy_(tensor + 1)
        else:
            out.copy_(torch.cat([tensor, tensor + 1]))

    return all_gather


def test_the_forms_of_one_gather_are_one_op():
    """A gather issued as all_gather_into_tensor in forward and all_gather_single in the recompute (what
    a backend or torch version may lower one call to) is the same collective: replayed."""
    runtime = _Runtime()
    cache = _Cache(runtime, TargetState(TARGET, ""))
    calls: list = []
    into_tensor = cache._wrap_c10d("all_gather_into_tensor", _gather_stand_in(calls))
    single = cache._wrap_c10d("all_gather_single", _gather_stand_in(calls))
    w = torch.ones(4, requires_grad=True)
    passes = []

    def region(x):
        out = torch.empty(4)
        (single if passes else into_tensor)(out, x.detach())  # forward: into_tensor; recompute: single
        passes.append(1)
        return out * w

    y = checkpoint(region, torch.ones(2, requires_grad=True), use_reentrant=False)
    y.sum().backward()
    assert len(calls) == 1, "the recompute issued the gather again"
    assert runtime.checks[-1][:2] == (CHECK, True), runtime.checks
    assert w.grad.tolist() == [1.0, 1.0, 2.0, 2.0]


_FSDP_SOURCE = '''
def unshard(all_gather_into_tensor, output, shard):
    all_gather_into_tensor(output, shard)
'''


def test_fsdps_own_gather_in_the_regions_forward_is_left_alone():
    """FSDP2's pre-forward unshard runs inside the region's forward and is not issued again in the
    recompute (torch 2.11's FSDP2 calls dist.all_gather_into_tensor): kept, it would stand first in
    the region's list and the recompute's own all_gather would be matched against it (NCCL, seed 001)."""
    namespace: dict = {}
    exec(compile(_FSDP_SOURCE, "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "exec"),
         namespace)
    runtime = _Runtime()
    cache = _Cache(runtime, TargetState(TARGET, ""))
    calls: list = []
    into_tensor = cache._wrap_c10d("all_gather_into_tensor", _gather_stand_in(calls))
    job_gather = cache._wrap_c10d("all_gather", _gather_stand_in(calls, list_form=True))
    w = torch.ones(4, requires_grad=True)
    unsharded = {"done": False}

    def region(x):
        if not unsharded["done"]:  # FSDP: the recompute finds the parameters already unsharded
            namespace["unshard"](into_tensor, torch.empty(4), torch.zeros(2))
            unsharded["done"] = True
        parts = [torch.empty(2), torch.empty(2)]
        job_gather(parts, x.detach())
        return torch.cat(parts) * w

    y = checkpoint(region, torch.ones(2, requires_grad=True), use_reentrant=False)
    y.sum().backward()
    assert len(calls) == 2, "FSDP's gather and the job's, each once"
    assert runtime.checks[-1][:2] == (CHECK, True), runtime.checks
    assert w.grad.tolist() == [1.0, 1.0, 2.0, 2.0]


def test_the_check_fails_when_the_fix_replays_another_collectives_result(monkeypatch):
    """The fix broken (it keeps each region's collectives in the wrong order): the check must fail,
    and the job must not go on with a result that belongs to another collective."""
    runtime, all_reduce, calls = _setup()
    original_keep = _Cache._keep

    def keep_first(self, region, key, inputs, outputs):  # broken: each new entry goes first
        original_keep(self, region, key, inputs, outputs)
        self.kept[region].insert(0, self.kept[region].pop())

    monkeypatch.setattr(_Cache, "_keep", keep_first)
    w = torch.ones(2, requires_grad=True)

    def region(x):
        a, b = torch.tensor([1]), torch.tensor([2])
        all_reduce(a)
        all_reduce(b)
        return x * w * (a + b)

    y = checkpoint(region, torch.ones(2, requires_grad=True), use_reentrant=False)
    with pytest.raises(RuntimeError, match="differs from the forward's"):
        y.sum().backward()
    assert runtime.checks[-1][0] == CHECK and runtime.checks[-1][1] is False
