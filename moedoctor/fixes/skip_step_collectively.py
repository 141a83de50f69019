"""``skip-step-collectively`` (pattern ``skipped-optimizer-step``): every rank skips, or none does.

Mechanism: the function that decides to skip the optimizer step (a local non-finite check of the
gradient norm, SkyRL PR #1370) is wrapped, or, when the decision is an ``if`` inline in the job's
code (``if not math.isfinite(loss.item()): continue``), that ``if``'s test is (``branch``: found by
the analysis from the stacks of the ranks that went each way, ``moedoctor.fixes.rewrite``): its
local answer becomes a flag, all-reduced with MAX
over the decision's process group (its ``group`` argument, else the default group), and the wrapper
returns the group's answer. So the ranks that would have stepped skip too, and nobody waits in the
optimizer's collectives alone. The caller's skip path must leave the step a true no-op: not calling
``step()`` does; zeroing gradients and stepping anyway does not (AdamW's weight decay and moments
still move the weights: seed 001's review).

Check (``moedoctor verify``): at every collective skip, a snapshot of every optimizer's parameters
(local shards), state tensors and hyper-parameters, and every LR scheduler's position; when the skip
is over (the next backward, the next decision, or the end of the job) they must be bitwise unchanged,
or, where the job's own skip path changed them without any ``optimizer.step()`` and without moving an
LR scheduler (DiLoCo resets the weights to the last global ones), that is said and passes: the
failure the check is for is a skip path that steps anyway.

Risk: one extra 1-element all-reduce per step. If one rank's gradients overflow every step, every
rank now skips every step (before, the job hung): watch the skip count.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Mapping
from typing import Any

from moedoctor.fixes.base import Fix, FixConfigError, Target, parse_targets
from moedoctor.fixes.rewrite import parse_branch
from moedoctor.fixes.runtime import agreed_branch, collective_device
from moedoctor.layout import REPORT

NAME = "skip-step-collectively"


def _parse_config(section: Mapping[str, Any]) -> dict:
    unknown = set(section) - {"decision", "returns", "branch"}
    if unknown:
        raise FixConfigError(f"unknown key(s) {sorted(unknown)}; expected 'decision', 'returns' or 'branch'")
    targets = parse_targets(section, "decision")
    returns = section.get("returns", "flag")
    if returns not in ("flag", "norm"):
        raise FixConfigError(f"returns: expected 'flag' (true = skip) or 'norm' (non-finite = skip), got {returns!r}")
    out: dict[str, Any] = {"targets": targets, "returns": returns}
    if section.get("branch") is not None:
        out["branch"] = parse_branch(section["branch"])
    return out


def _install(runtime) -> None:
    import torch
    import torch.distributed as dist

    returns = runtime.config.get("returns", "flag")
    snapshots = _StepSnapshots(runtime) if runtime.checks_enabled else None

    def make_collective(original, owner):
        if not callable(original):
            raise TypeError(f"{original!r} is not callable")
        signature = inspect.signature(original)

        def collective_decision(*args, **kwargs):
            if snapshots is not None:
                snapshots.compare()  # the previous skip, if any, must have changed nothing
            result = original(*args, **kwargs)
            group = None
            if "group" in signature.parameters:
                group = signature.bind(*args, **kwargs).arguments.get("group")
            local_skip = _wants_skip(result, returns)
            flag = torch.tensor([1.0 if local_skip else 0.0], device=collective_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            skip = bool(flag.item())
            if skip and snapshots is not None:
                snapshots.take()
            return _as_result(result, skip, returns)

        return collective_decision

    for target in runtime.fix.all_targets(runtime.config):
        runtime.patch(target, make_collective)
    branch = runtime.config.get("branch")
    if branch is not None:
        runtime.branch(branch, _branch_agreement(runtime, branch["agree"], snapshots))
    if snapshots is not None:
        snapshots.track()
        runtime.at_finish(snapshots.compare)


def _branch_agreement(runtime, agree: str, snapshots: _StepSnapshots | None):
    """The wrapped ``if``'s test, agreed by every rank (``runtime.agreed_branch``). ``any``: the test
    true means skip (``if bad: continue``, ``if overflow: ... else: step()``); ``all``: true means
    step (``if finite: step()``). A skip is snapshotted for the no-op check."""
    agreed = agreed_branch(runtime, agree)

    def decide(value: Any, line: int) -> bool:
        if snapshots is not None:
            snapshots.compare()  # the previous skip, if any, must have changed nothing
        result = agreed(value, line)
        if snapshots is not None and result == (agree == "any"):
            snapshots.take()
        return result

    return decide


def _wants_skip(result: Any, returns: str) -> bool:
    if returns == "norm":
        value = float(result.item() if hasattr(result, "item") else result)
        return not math.isfinite(value)
    return bool(result.item() if hasattr(result, "item") else result)


def _as_result(result: Any, skip: bool, returns: str) -> Any:
    """The group's decision in the type the caller expects."""
    import torch

    if returns == "norm":
        if not skip:
            return result
        return torch.full_like(result, math.inf) if isinstance(result, torch.Tensor) else math.inf
    if isinstance(result, torch.Tensor):
        return torch.full_like(result, skip)
    return type(result)(skip) if isinstance(result, (bool, int, float)) else skip


def _register_instances(cls, registry: weakref.WeakSet) -> None:
    """Add every instance of ``cls`` (and its subclasses, which call its ``__init__``) to ``registry``."""
    original = cls.__init__

    def init(obj, *args, **kwargs):
        original(obj, *args, **kwargs)
        registry.add(obj)

    cls.__init__ = init


class _StepSnapshots:
    """Everything a skipped step must leave alone, taken at the skip, compared when the skip is over:
    at the next backward (the next step's training has begun), the next decision, or the job's end.
    An ``optimizer.step()`` in between is the skip path stepping anyway (zeroed gradients: AdamW's
    weight decay and moments still move the weights); a change without one is the job's own handling
    of a skip (DiLoCo resets the weights to the last global ones), said, not failed."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.schedulers: weakref.WeakSet = weakref.WeakSet()
        self.pending: list[tuple[str, Any]] | None = None
        self.skips = 0
        self.stepped: list[str] = []  # optimizers that stepped while a skip was pending
        self.reset_by_job = 0  # skips whose path changed state without stepping

    def track(self) -> None:
        """Know every optimizer and LR scheduler the job creates (their ``__init__`` is wrapped), every
        optimizer step, and every backward (the end of a skip)."""
        import functools

        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _register_instances(torch.optim.Optimizer, self.optimizers)
        _register_instances(torch.optim.lr_scheduler.LRScheduler, self.schedulers)

        def stepping(optimizer, args, kwargs):
            if self.pending is not None:
                self.stepped.append(type(optimizer).__name__)

        register_optimizer_step_pre_hook(stepping)
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(*args, **kwargs):
            self.compare()  # a new backward: the skipped step is over
            return original(*args, **kwargs)

        torch.autograd.backward = backward

    def _state(self) -> list[tuple[str, Any]]:
        import torch

        def local(t):
            return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

        items: list[tuple[str, Any]] = []
        for i, optimizer in enumerate(list(self.optimizers)):
            for g, group in enumerate(optimizer.param_groups):
                items += [
                    (f"optimizer{i}.group{g}.{k}", v)
                    for k, v in group.items()
                    if k != "params" and isinstance(v, (int, float, bool, tuple))
                ]
                for p, param in enumerate(group["params"]):
                    items.append((f"optimizer{i}.group{g}.param{p}", local(param)))
                    for key, value in optimizer.state.get(param, {}).items():
                        value = local(value) if isinstance(value, torch.Tensor) else value
                        items.append((f"optimizer{i}.group{g}.param{p}.{key}", value))
        for i, scheduler in enumerate(list(self.schedulers)):
            items.append((f"scheduler{i}.last_epoch", scheduler.last_epoch))
            items.append((f"scheduler{i}.last_lr", tuple(getattr(scheduler, "_last_lr", ()) or ())))
        return items

    def take(self) -> None:
        self.skips += 1
        self.stepped = []
        self.pending = self._state()

    def compare(self) -> None:
        import torch

        if self.pending is None:
            return
        before, self.pending = self.pending, None
        after = dict(self._state())
        changed = []
        for key, value in before:
            now = after.get(key)
            same = (
                torch.equal(value, now)
                if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor)
                else value == now
            )
            if not same:
                changed.append(key)
        tensors = sum(isinstance(v, torch.Tensor) for _, v in before)
        listed = f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}"
        scheduled = [k for k in changed if k.startswith("scheduler")]
        if changed and (self.stepped or scheduled):
            why = f"{self.stepped[0]}.step() ran during the skip" if self.stepped else "an LR scheduler moved"
            self.runtime.check(
                "skipped step is a no-op",
                False,
                f"skip #{self.skips} changed {len(changed)} of {len(before)} items ({why}): {listed}",
            )
        elif changed:
            self.reset_by_job += 1
            self.runtime.check(
                "skipped step is a no-op",
                True,
                f"skip #{self.skips}: no optimizer stepped and no LR scheduler moved; the job's own skip path "
                f"changed {len(changed)} of {len(before)} items without a step (a reset: {listed})",
            )
        else:
            self.runtime.check(
                "skipped step is a no-op",
                True,
                f"{self.skips} skipped step(s): {tensors} tensors (params, optimizer state) "
                f"and {len(before) - tensors} hyper-parameters/scheduler values bitwise unchanged",
            )


FIX = Fix(
    name=NAME,
    patterns=("skipped-optimizer-step",),
    summary="make the skip-the-step decision collective (non-finite flag all-reduced with MAX)",
    mechanism="Wraps the function that decides to skip the optimizer step; its local answer is "
    "all-reduced with MAX over the decision's group, so every rank skips or none does.",
    risk="One 1-element all-reduce per step. The caller's skip path must not call step() (AdamW weight "
    "decay moves weights even with zero grads); the check catches that. A rank that overflows every "
    "step now makes every rank skip every step.",
    cost="one 1-element all-reduce (and a host sync on its flag) per step",
    check="at each skip, params, optimizer state, hyper-parameters and LR schedulers are snapshotted; "
    "when the skip is over (next backward or decision) they must be bitwise unchanged, unless the job's "
    "own skip path changed them without an optimizer step or an LR scheduler moving (a reset, said)",
    targets=(Target("_lib.sharded_optim:grad_norm_is_nonfinite", "moedoctor's fixtures"),),
    install=_install,
    by_structure="the `if` in your code that decided to skip (its test made collective)",
    parse_config=_parse_config,
    config_help="decision: 'module:function' (returns true to skip, or the grad norm with returns: norm); or "
    "branch: {file: PATH, line: N, agree: any|all} (an `if` of your code, made collective: written "
    f"by `moedoctor analyze` into {REPORT} when it finds the decision)",
)
