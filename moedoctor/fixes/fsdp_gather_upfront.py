"""``fsdp-gather-upfront`` (pattern ``inflight-metric-allreduce``): gather kept FSDP2 units first.

Mechanism: an FSDP2 unit built with ``reshard_after_forward=False`` is all-gathered by the first
forward that uses it and stays unsharded until a backward reshards it. When which micro-batch first
uses a unit depends on the data (MoE routing, a vision tower only for batches with images, a task
head per batch), its all-gather lands at a different place of each rank's stream, and a metric
all-reduce issued from the loop meets it (``inflight-metric-allreduce``). This fix watches FSDP2
roots through torch's global module forward pre-hook (no class or function of the job is named):
at the start of a root's forward, every unit under it that stays unsharded after forward and is
sharded now is unsharded (``FSDPModule.unshard()``), in module order. So those all-gathers happen at
one place, in one order, on every rank; the job's own lazy gathers become no-ops and the metric
all-reduce meets the metric all-reduce. The metric code is untouched: every reported value and
every gradient is the job's own.

Check (``moedoctor verify``): "ranks agreed on the units to gather": before each up-front gather,
one 4-element all-reduce (MAX of the number of units and of their names' hash, and of their
negatives) over the root's all-gather group. Ranks whose sets differ (a unit resharded on some ranks
only) fail it, and then none of them gathers anything up front (the collective stays matched).

Risk: memory: every kept unit is unsharded from the step's first forward on (the job would reach
that peak anyway once each unit is used). Units that reshard after forward are left alone; a job
where those are used sparsely has the ``inactive-experts`` problem instead. Backward is unchanged:
reduce-scatters still come from the hooks, in the order autograd reaches the units.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Mapping
from typing import Any

from moedoctor.fixes.base import Fix, FixConfigError
from moedoctor.fixes.runtime import TargetState, collective_device
from moedoctor.layout import REPORT

NAME = "fsdp-gather-upfront"
TARGET = "FSDP2 roots (by structure; units kept unsharded after forward, gathered as the root's forward starts)"
CHECK = "ranks agreed on the units to gather"


def _parse_config(section: Mapping[str, Any]) -> dict:
    section = dict(section or {})
    units = section.pop("units", None)
    if section:
        raise FixConfigError(f"unknown key(s) {sorted(section)}; expected 'units'")
    if units not in (None, "kept"):
        raise FixConfigError(f"units: expected 'kept' (every unit with reshard_after_forward=False), got {units!r}")
    return {"units": "kept"}


def _install(runtime) -> None:
    state = runtime.targets.setdefault(TARGET, TargetState(TARGET, "units: kept"))
    _Upfront(runtime, state).install()


def _param_groups(module: Any) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.8: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _kept(module: Any) -> bool:
    """Does this unit stay unsharded after forward (``reshard_after_forward=False``)?"""
    groups = _param_groups(module)
    return bool(groups) and all(getattr(g, "post_forward_mesh_info", True) is None for g in groups)


def _sharded(module: Any) -> bool:
    return any(not getattr(g, "is_unsharded", True) for g in _param_groups(module))


class _Upfront:
    def __init__(self, runtime, state: TargetState) -> None:
        self.runtime = runtime
        self.state = state
        self.roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> [(name, unit)]
        self.inner: weakref.WeakSet = weakref.WeakSet()
        self.local = threading.local()
        self.gathered = 0
        self.fsdp_module: type | None = None

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:
            self.runtime.note("this torch has no FSDP2 (torch.distributed.fsdp.FSDPModule): nothing to gather")
            return
        self.fsdp_module = FSDPModule
        self.state.patched = True
        register_module_forward_pre_hook(self._pre)
        self.runtime.at_finish(self._finish)

    def _pre(self, module: Any, args: tuple) -> None:
        if getattr(self.local, "busy", False) or module in self.inner or not isinstance(module, self.fsdp_module):
            return
        if module not in self.roots:
            if not self._is_new_root(module):
                return
        self.local.busy = True
        try:
            self._gather(module)
        finally:
            self.local.busy = False

    def _is_new_root(self, module: Any) -> bool:
        """The first FSDP module to start a forward before FSDP initialised it lazily is a root (the
        outermost forward's pre-hooks run first); every FSDP module under it is one of its units."""
        fsdp_state = module._get_fsdp_state()
        if getattr(fsdp_state, "_is_root", None) is False:
            self.inner.add(module)
            return False
        units = [(name, m) for name, m in module.named_modules() if isinstance(m, self.fsdp_module)]
        for _, unit in units[1:]:
            self.inner.add(unit)
        kept = [(name or "<root>", unit) for name, unit in units if _kept(unit)]
        self.roots[module] = kept
        if len(kept) < 2:
            self.runtime.note(
                f"{type(module).__name__}: {len(kept)} unit(s) kept unsharded after forward "
                "(reshard_after_forward=False): nothing to gather up front"
            )
        return True

    def _gather(self, root: Any) -> None:
        kept = self.roots[root]
        pending = [(name, unit) for name, unit in kept if _sharded(unit)]
        if not pending:
            return
        lazy = getattr(root._get_fsdp_state(), "_lazy_init", None)
        if callable(lazy):
            lazy()  # what the root's own pre-forward does first (it sets up the groups); a no-op once done
        if self.runtime.checks_enabled and not self._agreed(pending[0][1], [name for name, _ in pending]):
            return
        for _, unit in pending:
            unit.unshard()
        self.gathered += len(pending)
        self.state.calls += 1
        if self.state.calls == 1:
            self.runtime.write()

    def _agreed(self, unit: Any, names: list[str]) -> bool:
        """Over the all-gather group of the first unit to gather (the root may own no parameters)."""
        import torch
        import torch.distributed as dist

        groups = _param_groups(unit)
        group = getattr(groups[0], "_all_gather_process_group", None) if groups else None
        if group is None or not dist.is_initialized():
            self.runtime.check(CHECK, None, "the units' all-gather group is not known: not checked")
            return True
        count, digest = len(names), zlib.crc32("\n".join(names).encode())
        votes = torch.tensor([count, -count, digest, -digest], dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        high, low, high_digest, low_digest = votes.tolist()
        same = high == -low and high_digest == -low_digest
        self.runtime.check(
            CHECK,
            same,
            f"{count} unit(s) gathered up front ({', '.join(names[:4])}{', ...' if count > 4 else ''})"
            if same
            else f"the ranks' sets of sharded units differ ({count} here, {-low}..{high} across the "
            "group): nothing gathered up front",
        )
        return same

    def _finish(self) -> None:
        if self.roots and not self.gathered:
            self.runtime.note(
                "no unit was gathered up front: every kept unit was already unsharded when its root's forward started"
            )


FIX = Fix(
    name=NAME,
    patterns=("inflight-metric-allreduce",),
    summary="all-gather every FSDP2 unit kept unsharded after forward when its root's forward starts",
    mechanism="Through torch's global module forward pre-hook: at the start of an FSDP2 root's forward, every "
    "unit under it with reshard_after_forward=False that is sharded is unsharded, in module order, so "
    "their all-gathers no longer wait for the first micro-batch that happens to use them.",
    risk="Every kept unit is unsharded from the step's first forward (the peak the job reaches once it uses "
    "them all). Units that reshard after forward are left alone. Metric code and numbers are unchanged.",
    cost="none per collective; the same all-gathers, earlier (with checks: one 4-element all-reduce per gather)",
    check="before each up-front gather the ranks all-reduce the count and a hash of the units they will gather; "
    "ranks that disagree fail the check and gather nothing up front",
    targets=(),
    install=_install,
    parse_config=_parse_config,
    by_structure="FSDP2 units kept unsharded after forward (units: kept; no class needed)",
    config_help="units: kept (every FSDP2 unit with reshard_after_forward=False, gathered when its root's "
    f"forward starts; written by `moedoctor analyze` into {REPORT})",
)
