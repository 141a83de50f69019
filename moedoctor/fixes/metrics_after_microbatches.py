"""``metrics-after-microbatches`` (pattern ``inflight-metric-allreduce``): reduce metrics once per step.

Mechanism: two functions of the training code are wrapped. ``loop`` runs one step's micro-batch
loop and returns the step's metrics (a mapping, or a tuple/list whose first mapping is the metrics);
``reduce`` reduces a mapping metric-name -> local value across ranks (SkyRL's ``all_reduce_metrics``).
While ``loop`` runs (per thread, nested calls counted), ``reduce`` issues no collective: it returns a
copy of its input, so the loop accumulates local values. When the outermost ``loop`` returns, the
metrics mapping of its result is replaced by one call of the original ``reduce``, with the arguments
of the last in-loop call: one metric reduction per step, after the last micro-batch's backward, on
every rank (seed 000, SkyRL PR #1370). Outside ``loop``, ``reduce`` is unchanged.

Check (``moedoctor verify``): the reported metrics must equal what the original code reports when it
does not hang. That one post-loop call also carries each micro-batch's local values under extra keys
(``mb<i>@<key>``: the key's suffix is kept, since reducers dispatch on it, e.g. ``*_max``), so the
same reduction yields the per-micro-batch reduced values the original computed. Where the loop's
local aggregate of a key is the mean (or sum, max, min) of its per-micro-batch values, the original
report is that aggregate of the reduced per-micro-batch values, compared with the fixed value
(relative tolerance 1e-9). The extra keys are sent only if every rank has the same ones: one
4-element all-reduce (MAX of count and key hash, and of their negatives) agrees on that first.

Risk: none on the collective stream without checks (N-1 fewer all-reduces per step). Code inside the
loop that uses the reduced values (logging per micro-batch, early stopping on a global value) now
sees local ones. A metric reduced with MAX but averaged over micro-batches is reported differently
(max of means instead of mean of maxes): the check reports it as a difference.
"""

from __future__ import annotations

import inspect
import math
import threading
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from moedoctor.fixes.base import Fix, FixConfigError, Target, parse_target
from moedoctor.fixes.runtime import collective_device, first_mapping_argument

NAME = "metrics-after-microbatches"
REDUCE = Target("__main__:all_reduce_metrics", "moedoctor's fixture: reduces a metric dict")
LOOP = Target("__main__:train_step", "moedoctor's fixture: one step's micro-batch loop")
CHECK = "metrics equal the in-loop reduction"
REL_TOL = 1e-9
ABS_TOL = 1e-12
_AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda values: sum(values) / len(values),
    "sum": sum,
    "max": max,
    "min": min,
}


def _parse_config(section: Mapping[str, Any]) -> dict:
    if not section:
        return {}
    unknown = set(section) - {"reduce", "loop"}
    if unknown:
        raise FixConfigError(f"unknown key(s) {sorted(unknown)}; expected 'reduce' and 'loop'")
    missing = [key for key in ("reduce", "loop") if key not in section]
    if missing:
        raise FixConfigError(
            f"missing {' and '.join(repr(k) for k in missing)}: give both 'reduce' (the "
            "function that reduces a metric dict) and 'loop' (the function that runs "
            "one step's micro-batches)"
        )
    reduce = parse_target(section["reduce"], "reduce").path
    loop = parse_target(section["loop"], "loop").path
    if reduce == loop:
        raise FixConfigError(f"reduce and loop are both {reduce!r}; they must be two functions")
    return {"reduce": reduce, "loop": loop, "targets": [reduce, loop]}


def _install(runtime) -> None:
    config = runtime.config
    if config.get("reduce"):  # the configured pair replaces the fixture's
        reduce, loop = Target(config["reduce"], "from --config"), Target(config["loop"], "from --config")
    else:
        reduce, loop = REDUCE, LOOP
    deferral = _DeferredReduction(runtime)
    runtime.patch(reduce, deferral.make_reduce)
    runtime.patch(loop, deferral.make_loop)
    runtime.at_finish(deferral.finish)


class _StepState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.local_values: list[Mapping] = []  # the input of every in-loop reduce call
        self.last_call: tuple[tuple, dict, int | str] | None = None  # its args, kwargs, the mapping's place


class _DeferredReduction:
    """The ``reduce``/``loop`` pair: in-loop reductions deferred to one call after the loop."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.state = _StepState()
        self.original_reduce: Callable | None = None
        self.reduce_signature: inspect.Signature | None = None
        self.steps = 0  # loop calls whose reduction was deferred
        self.calls_outside = 0  # reduce calls outside any loop: not deferred

    def finish(self) -> None:
        if self.steps == 0 and self.calls_outside:
            self.runtime.note(
                f"deferred no reduction: the reduce function ran {self.calls_outside} time(s), "
                "never inside the loop function (check the loop target)"
            )

    # -- the wrappers -----------------------------------------------------------------------------

    def make_reduce(self, original, owner):
        if not callable(original):
            raise TypeError(f"{original!r} is not callable")
        self.original_reduce = original
        try:
            self.reduce_signature = inspect.signature(original)
        except (TypeError, ValueError):
            self.reduce_signature = None

        def reduce_after_microbatches(*args, **kwargs):
            state = self.state
            place = first_mapping_argument(args, kwargs)
            if state.depth == 0 or place is None:
                self.calls_outside += 1
                return original(*args, **kwargs)
            metrics = args[place] if isinstance(place, int) else kwargs[place]
            local = dict(metrics)
            state.local_values.append(dict(local))
            state.last_call = (args, kwargs, place)
            return local  # the caller accumulates local values; reduced once after the loop

        return reduce_after_microbatches

    def make_loop(self, original, owner):
        if not callable(original):
            raise TypeError(f"{original!r} is not callable")

        def loop_reducing_after(*args, **kwargs):
            state = self.state
            outer = state.depth == 0
            if outer:
                state.local_values, state.last_call = [], None
            state.depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                state.depth -= 1
            if not outer:
                return result
            local_values, last_call = state.local_values, state.last_call
            state.local_values, state.last_call = [], None
            if last_call is None:  # nothing was reduced in the loop: nothing to defer
                return result
            return self._reduce_result(result, local_values, last_call)

        return loop_reducing_after

    # -- after the loop ---------------------------------------------------------------------------

    def _reduce_result(self, result: Any, local_values: list[Mapping], last_call) -> Any:
        index = _metrics_index(result)
        if index is None:
            self.runtime.note(
                f"the loop returned {type(result).__name__}, with no metrics mapping: its "
                "metrics stay local (not reduced across ranks)"
            )
            return result
        metrics = result if index == -1 else result[index]
        self.steps += 1
        reduced = self._reduce_once(metrics, local_values, last_call)
        if index == -1:
            return reduced
        items = list(result)
        items[index] = reduced
        if isinstance(result, tuple):
            return type(result)._make(items) if hasattr(result, "_fields") else type(result)(items)  # type: ignore[attr-defined]
        return type(result)(items)

    def _call_reduce(self, mapping: Mapping, last_call) -> Any:
        args, kwargs, place = last_call
        if isinstance(place, int):
            args = args[:place] + (mapping,) + args[place + 1 :]
        else:
            kwargs = {**kwargs, place: mapping}
        return self.original_reduce(*args, **kwargs)

    def _reduce_once(self, metrics: Mapping, local_values: list[Mapping], last_call) -> Any:
        if not self.runtime.checks_enabled:
            return self._call_reduce(metrics, last_call)
        extras = _per_microbatch_keys(metrics, local_values)
        # Every rank takes part in this one agreement, extra keys or none, so it cannot desync.
        if not self._ranks_agree(extras, last_call):
            self.runtime.check(
                CHECK,
                None,
                f"step {self.steps}: the ranks' per-micro-batch keys differ "
                "(micro-batch counts or metric keys): not checked",
            )
            return self._call_reduce(metrics, last_call)
        if not extras:
            self.runtime.check(
                CHECK, None, f"step {self.steps}: no metric has a number in the micro-batches: not checked"
            )
            return self._call_reduce(metrics, last_call)
        try:
            reduced = self._call_reduce({**metrics, **extras}, last_call)
        except Exception as e:  # the reducer rejects the extra keys: report, then reduce as the job would
            self.runtime.check(
                CHECK,
                None,
                f"step {self.steps}: the reduce function rejected the extra per-micro-batch keys ({e!r}): not checked",
            )
            return self._call_reduce(metrics, last_call)
        if not isinstance(reduced, Mapping) or not all(key in reduced for key in extras):
            self.runtime.check(
                CHECK,
                None,
                f"step {self.steps}: the reduce function did not return the "
                "per-micro-batch keys it was given: not checked",
            )
            return _without(reduced, extras)
        self._compare(metrics, local_values, reduced)
        return _without(reduced, extras)

    def _ranks_agree(self, extras: Mapping, last_call) -> bool:
        """One fixed-size all-reduce: do all ranks hold the same extra keys (count and names)?"""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return True
        count, digest = len(extras), zlib.crc32("\n".join(extras).encode())
        group = self._group(last_call)
        votes = torch.tensor([count, -count, digest, -digest], dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        high_count, low_count, high_digest, low_digest = votes.tolist()
        return high_count == -low_count and high_digest == -low_digest

    def _group(self, last_call):
        if self.reduce_signature is None or "group" not in self.reduce_signature.parameters:
            return None
        args, kwargs, _ = last_call
        try:
            return self.reduce_signature.bind(*args, **kwargs).arguments.get("group")
        except TypeError:
            return None

    def _compare(self, metrics: Mapping, local_values: list[Mapping], reduced: Mapping) -> None:
        compared, unverified, worst, differing = 0, [], 0.0, []
        for key, value in metrics.items():
            local_aggregate = _as_float(value)
            per_mb_local = [_as_float(values.get(key)) for values in local_values]
            if local_aggregate is None or any(v is None for v in per_mb_local):
                unverified.append(f"{key} (not a number in every micro-batch)")
                continue
            aggregate = _aggregate_of(local_aggregate, per_mb_local)
            if aggregate is None:
                unverified.append(
                    f"{key} (the loop's value is not the mean, sum, max or min of its micro-batch values)"
                )
                continue
            per_mb_reduced = [_as_float(reduced.get(_extra_key(i, key))) for i in range(len(local_values))]
            fixed = _as_float(reduced.get(key))
            if fixed is None or any(v is None for v in per_mb_reduced):
                unverified.append(f"{key} (the reduction returned no number)")
                continue
            original = _AGGREGATES[aggregate](per_mb_reduced)
            difference = abs(fixed - original) / max(abs(original), ABS_TOL)
            compared += 1
            worst = max(worst, difference)
            if not math.isclose(fixed, original, rel_tol=REL_TOL, abs_tol=ABS_TOL):
                differing.append(
                    f"{key}: {fixed!r} after the loop vs {original!r} in the loop "
                    f"({aggregate} over {len(per_mb_reduced)} micro-batches)"
                )
        skipped = f"; not checked: {', '.join(unverified)}" if unverified else ""
        if differing:
            self.runtime.check(CHECK, False, f"step {self.steps}: {'; '.join(differing)}{skipped}", worst)
        elif compared:
            self.runtime.check(
                CHECK,
                True,
                f"{compared} metric(s) per step equal the per-micro-batch "
                f"reduction (relative tolerance {REL_TOL:g}){skipped}",
                worst,
            )
        else:
            self.runtime.check(CHECK, None, f"step {self.steps}: no metric could be compared{skipped}")


def _metrics_index(result: Any) -> int | None:
    """-1 if ``result`` is the metrics mapping, else the index of its first mapping element."""
    if isinstance(result, Mapping):
        return -1
    if isinstance(result, (tuple, list)):
        for index, value in enumerate(result):
            if isinstance(value, Mapping):
                return index
    return None


def _extra_key(microbatch: int, key: str) -> str:
    return f"mb{microbatch}@{key}"


def _per_microbatch_keys(metrics: Mapping, local_values: list[Mapping]) -> dict[str, Any]:
    """Each micro-batch's local value of each metric of the step, under its own key."""
    extras: dict[str, Any] = {}
    for index, values in enumerate(local_values):
        for key in metrics:
            if isinstance(key, str) and key in values and _as_float(values[key]) is not None:
                extras[_extra_key(index, key)] = values[key]
    return extras


def _aggregate_of(local_aggregate: float, per_mb_local: list[float]) -> str | None:
    """Which aggregate of the micro-batch values the loop reported locally (the first that fits)."""
    for name, aggregate in _AGGREGATES.items():
        if math.isclose(local_aggregate, aggregate(per_mb_local), rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return name
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "item"):
        try:
            return float(value.item()) if numel() == 1 else None
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _without(reduced: Any, extras: Mapping) -> Any:
    if not isinstance(reduced, Mapping):
        return reduced
    return {key: value for key, value in reduced.items() if key not in extras}


FIX = Fix(
    name=NAME,
    patterns=("inflight-metric-allreduce",),
    summary="keep metrics local in the micro-batch loop, reduce them once after the last micro-batch",
    mechanism="Wraps the metric-reduce function and the step's micro-batch loop: inside the loop the "
    "reduce returns its local input; when the loop returns, its metrics are reduced once, "
    "with the original function, on every rank.",
    risk="Code inside the loop that reads the reduced values sees local ones. A metric reduced with MAX "
    "but averaged over micro-batches changes meaning (the check reports it). Without checks it adds "
    "no collective and removes N-1 metric reductions per step of N micro-batches.",
    cost="none; N-1 fewer metric reductions per step (with checks: one 4-element all-reduce per step and "
    "the per-micro-batch values as extra keys of the one reduction)",
    check="the post-loop reduction also reduces each micro-batch's local values; the original report "
    "(their mean, sum, max or min, as the loop aggregates) must equal the fixed value (rel. 1e-9)",
    targets=(REDUCE, LOOP),
    install=_install,
    parse_config=_parse_config,
    config_help="reduce: 'module:function' (reduces a metric dict across ranks); loop: 'module:function' "
    "(runs one step's micro-batches, returns the metrics)",
)
