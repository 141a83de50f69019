"""``recompute-cache-collective`` (pattern ``collective-in-checkpointed-region``): a checkpoint's
recompute replays the forward's collectives instead of issuing them again.

Mechanism: non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``, ``checkpoint_wrapper(NO_REENTRANT)``, transformers' gradient checkpointing)
runs the region's function again in backward. A collective inside it is then issued a second time,
and where one rank's recompute stops before it (early stop) or never runs, the ranks desync. This fix
wraps the synchronous c10d collectives the job calls through ``torch.distributed`` (``all_reduce``,
``all_gather``, ``all_gather_into_tensor``, ``all_gather_single``, ``broadcast``) and the functional
``all_gather_tensor`` and ``all_reduce``; each is keyed by its canonical op
(``moedoctor.trace.op_names``), so the list and the tensor forms of a gather are one op, whichever a
backend or torch version lowers it to. Called inside a checkpointed region's forward (torch's own ``checkpoint`` frame
on the stack, whose generator holds the region's ``_CheckpointFrame``), the collective runs and its
input and result are kept, in order, for that region instance; called inside that region's recompute
(the region's ``unpack_hook`` frame on the stack), the next kept result is written into the job's
output tensors (or returned, for a functional collective) and nothing is issued. No rank issues the
collective in backward, so whether its recompute reaches it no longer matters. Collectives outside
checkpointed regions, ``async_op=True`` calls, results above ``MAX_ELEMENTS`` and FSDP's own
collectives are left alone. FSDP's are issued by its pre-forward hook, which runs inside the region's
forward, but FSDP does not issue them again in the recompute (its pre-backward hook has already
unsharded the parameters): kept, they would stand first in the region's list and the recompute's
first collective would be matched against FSDP's gather (this is what failed on NCCL with torch 2.11,
whose FSDP2 gathers through ``dist.all_gather_into_tensor``: "collective 1 of the region is
all_gather in the recompute, all_gather_into_tensor in forward"). A collective called while another
wrapped one runs (a torch function that calls another) is the outer one's, not kept twice.

Check (``moedoctor verify``): "replayed results are the forward's": each replay compares the
recompute's input with the forward's, bitwise, with the canonical op, group, shapes and dtypes, and
the recompute's output tensors with the kept results' shapes and dtypes; only then is
the forward's result the one the collective would return. On a difference the fix raises (the job
fails, the check fails): replaying a stale result would change the job's numbers silently.

Risk: memory: the inputs and results of the region's collectives are kept from forward to backward
(small ones: positions, counts); a job whose recompute legitimately sees other inputs than its
forward fails loudly instead of hanging. Reads torch's private checkpoint frames: a torch whose
``torch/utils/checkpoint.py`` is laid out otherwise makes the fix find no region (a note, no replay).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from moedoctor.fixes.base import Fix, FixConfigError
from moedoctor.fixes.runtime import TargetState
from moedoctor.trace.op_names import canonical_op
from moedoctor.layout import REPORT

NAME = "recompute-cache-collective"
TARGET = "torch.distributed collectives inside non-reentrant checkpointed regions (by structure)"
CHECK = "replayed results are the forward's"
#: Results kept per collective at most (elements); larger collectives are issued as usual.
MAX_ELEMENTS = 1 << 20
_CKPT_FILE = "torch/utils/checkpoint.py"
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast")
#: Where FSDP's own collectives are called from (FSDP1, FSDP2, and FSDP2's older home).
_FSDP_FILES = ("torch/distributed/fsdp/", "torch/distributed/_composable/fsdp/")
_FUNCOL = ("all_gather_tensor", "all_reduce")


def _parse_config(section: Mapping[str, Any]) -> dict:
    section = dict(section or {})
    regions = section.pop("regions", None)
    if section:
        raise FixConfigError(f"unknown key(s) {sorted(section)}; expected 'regions'")
    if regions not in (None, "checkpointed"):
        raise FixConfigError(f"regions: expected 'checkpointed', got {regions!r}")
    return {"regions": "checkpointed"}


def _install(runtime) -> None:
    state = runtime.targets.setdefault(TARGET, TargetState(TARGET, "regions: checkpointed"))
    _Cache(runtime, state).install()


def _region() -> tuple[str, Any] | None:
    """``("forward", frame)`` inside a checkpointed region's forward, ``("recompute", frame)`` inside
    its recompute (innermost first), else None; ``frame`` is torch's ``_CheckpointFrame``."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_filename.replace("\\", "/").endswith(_CKPT_FILE):
            if code.co_name == "unpack_hook" and "frame" in code.co_freevars:
                region = f.f_locals.get("frame")
                if region is not None and hasattr(region, "recompute_fn"):
                    return "recompute", region
            elif code.co_name == "checkpoint":
                gen = f.f_locals.get("gen")
                region = getattr(getattr(gen, "gi_frame", None), "f_locals", {}).get("new_frame")
                if region is not None:
                    return "forward", region
        f = f.f_back
    return None


def _called_by_fsdp() -> bool:
    """The wrapped collective's caller is FSDP itself (its unshard or reshard)."""
    caller = sys._getframe(2).f_code.co_filename.replace("\\", "/")
    return any(part in caller for part in _FSDP_FILES)


def _tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Cache:
    def __init__(self, runtime, state: TargetState) -> None:
        self.runtime = runtime
        self.state = state
        # region (_CheckpointFrame) -> [kept entries]; recompute position per region
        self.kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.position: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.local = threading.local()  # .busy: a wrapped collective runs in this thread
        self.replayed = 0

    def install(self) -> None:
        import torch.distributed as dist

        for name in _C10D:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap_c10d(name, original))
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:
            funcol = None
        if funcol is not None:
            for name in _FUNCOL:
                original = getattr(funcol, name, None)
                if original is not None:
                    setattr(funcol, name, self._wrap_funcol(name, original))
        self.state.patched = True
        self.runtime.at_finish(self._finish)

    # -- c10d: results written into the job's tensors --------------------------------------------

    def _wrap_c10d(self, name: str, original):
        cache = self

        op = canonical_op(name) or name

        def wrapper(*args, **kwargs):
            if kwargs.get("async_op") or (len(args) > 3 and args[3]) or cache.busy() or _called_by_fsdp():
                return original(*args, **kwargs)
            where = _region()
            if where is None:
                return original(*args, **kwargs)
            mode, region = where
            outputs, inputs = cache._c10d_tensors(name, args, kwargs)
            if outputs is None or sum(t.numel() for t in outputs) > MAX_ELEMENTS:
                return original(*args, **kwargs)
            key = (op, id(kwargs.get("group", args[2] if len(args) > 2 else None)))
            if mode == "forward":
                result = cache.issue(original, args, kwargs)
                cache._keep(region, key, inputs, [t.detach().clone() for t in outputs])
                return result
            kept = cache._replay(region, key, inputs, outputs)
            for t, value in zip(outputs, kept):
                t.copy_(value)
            return None

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def busy(self) -> bool:
        """A wrapped collective is running in this thread: the one called now is part of it."""
        return getattr(self.local, "busy", False)

    def issue(self, original, args: tuple, kwargs: dict):
        self.local.busy = True
        try:
            return original(*args, **kwargs)
        finally:
            self.local.busy = False

    @staticmethod
    def _c10d_tensors(name: str, args: tuple, kwargs: dict) -> tuple[list | None, list]:
        """(the tensors the collective writes, its inputs) from the job's arguments."""

        def arg(i: int, key: str):
            return args[i] if len(args) > i else kwargs.get(key)

        if name == "all_reduce":
            t = arg(0, "tensor")
            return ([t], [t.detach().clone()]) if t is not None else (None, [])
        if name == "broadcast":
            t = arg(0, "tensor")
            return ([t], [t.detach().clone()]) if t is not None else (None, [])
        if name == "all_gather":
            out, inp = arg(0, "tensor_list"), arg(1, "tensor")
            return (list(out), [inp.detach().clone()]) if out is not None and inp is not None else (None, [])
        out, inp = arg(0, "output_tensor"), arg(1, "input_tensor")
        return ([out], [inp.detach().clone()]) if out is not None and inp is not None else (None, [])

    # -- functional collectives: the result returned ---------------------------------------------

    def _wrap_funcol(self, name: str, original):
        cache = self

        op = "funcol." + (canonical_op(name) or name)

        def wrapper(*args, **kwargs):
            if cache.busy() or _called_by_fsdp():
                return original(*args, **kwargs)
            where = _region()
            if where is None:
                return original(*args, **kwargs)
            mode, region = where
            inputs = [t.detach().clone() for t in _tensors(args[:1])]
            key = (op, len(inputs))
            if mode == "forward":
                result = cache.issue(original, args, kwargs)
                kept = [t.detach().clone() for t in _tensors(result)]
                if len(kept) != 1 or kept[0].numel() > MAX_ELEMENTS:
                    return result
                cache._keep(region, key, inputs, kept)
                return result
            (value,) = cache._replay(region, key, inputs)
            return value.clone()

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    # -- the cache ---------------------------------------------------------------------------------

    def _keep(self, region: Any, key: tuple, inputs: list, outputs: list) -> None:
        with self.lock:
            self.kept.setdefault(region, []).append((key, inputs, outputs))
            self.position[region] = 0

    def _replay(self, region: Any, key: tuple, inputs: list, outputs: list | None = None) -> list:
        with self.lock:
            entries = self.kept.get(region, [])
            i = self.position.get(region, 0)
            self.position[region] = i + 1
        problem = None
        if i >= len(entries):
            problem = f"the recompute issues collective {i + 1} of its region, the forward issued {len(entries)}"
        else:
            kept_key, kept_inputs, kept = entries[i]
            if kept_key[0] != key[0]:
                problem = f"collective {i + 1} of the region is {key[0]} in the recompute, {kept_key[0]} in forward"
            elif kept_key != key:
                problem = f"collective {i + 1} of the region is {key[0]} in both, but on another group in forward"
            elif len(kept_inputs) != len(inputs) or any(
                a.shape != b.shape or a.dtype != b.dtype or not bool((a == b).all())
                for a, b in zip(kept_inputs, inputs)
            ):
                problem = f"the input of {key[0]} (collective {i + 1} of the region) differs from the forward's"
            elif outputs is not None and (
                len(outputs) != len(kept)
                or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(outputs, kept))
            ):
                problem = (
                    f"the output tensors of {key[0]} (collective {i + 1} of the region) are not shaped as the forward's"
                )
        if problem is not None:
            if self.runtime.checks_enabled:
                self.runtime.check(CHECK, False, problem)
                self.runtime.write()
            raise RuntimeError(f"moedoctor {NAME}: {problem}: the forward's result cannot stand in for it")
        self.replayed += 1
        self.state.calls += 1
        if self.runtime.checks_enabled:
            done = f"{self.replayed} collective(s) replayed from forward, inputs bitwise equal"
            self.runtime.check(CHECK, True, done)
        if self.state.calls == 1:
            self.runtime.write()
        return kept

    def _finish(self) -> None:
        if not self.replayed:
            self.runtime.note("no collective was issued again by a checkpoint recompute: nothing replayed")


FIX = Fix(
    name=NAME,
    patterns=("collective-in-checkpointed-region",),
    summary="replay a checkpointed region's collectives in its recompute instead of issuing them again",
    mechanism="Wraps torch.distributed's synchronous all_reduce / all_gather / all_gather_into_tensor / "
    "all_gather_single / broadcast and the functional all_gather_tensor / all_reduce (FSDP's own left alone: "
    "FSDP does not issue them again in the recompute), keyed by canonical op: inside a non-reentrant checkpointed "
    "region's forward (torch's checkpoint frame on the stack) each result is kept for that region "
    "instance; inside its recompute (the region's unpack hook on the stack) the kept result is written "
    "into the job's tensors in order and nothing is issued, so no rank issues the collective in backward.",
    risk="Keeps the inputs and results of the regions' collectives (up to 1M elements each) from forward to "
    "backward. Raises, instead of replaying, when the recompute's collective or input differs from the "
    "forward's. Reads torch's private checkpoint frames (torch/utils/checkpoint.py).",
    cost="a Python stack walk per collective the job calls through torch.distributed while the fix is on",
    check="each replay compares the recompute's input, canonical op, shapes and dtypes with the forward's, bitwise, "
    "and its output tensors' shapes with the kept results'; "
    "a difference fails the check and raises",
    targets=(),
    install=_install,
    parse_config=_parse_config,
    by_structure="collectives inside non-reentrant checkpointed regions (regions: checkpointed; no class needed)",
    config_help="regions: checkpointed (every collective inside a non-reentrant checkpointed region; written "
    f"by `moedoctor analyze` into {REPORT})",
)
