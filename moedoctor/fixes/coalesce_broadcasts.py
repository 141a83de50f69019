"""``coalesce-broadcasts`` (pattern ``broadcast-storm``): one broadcast per bucket, not per tensor.

Mechanism: inside a target function (a state-dict loader, ``sync_module_states``, an
optimizer-state broadcast: named by ``--config``, or found by the analysis from the storm's call
site), every synchronous ``dist.broadcast`` is deferred into a bucket per (group, source rank,
device). A bucket is flushed as one coalesced broadcast (``dist._broadcast_coalesced``, which
flattens per dtype into ``buffer`` sized chunks; without it, the tensors are flattened per dtype with
``torch._utils._flatten_dense_tensors``, sent with one ``dist.broadcast`` and copied back) when it
reaches ``bucket_mb`` (500 MB by default, as in seed 000), before any other collective the process
issues through ``torch.distributed`` while the target runs, and when the target returns (or
raises). Asynchronous broadcasts (``async_op=True``), broadcasts outside a target, and broadcasts
torch's own code issues inside it (``set_model_state_dict`` slices each one's result at once) are
untouched.

Check (``moedoctor verify``): when the outermost target returns, a per-tensor fingerprint (the sum
of each tensor's bytes as int64) of every tensor that was deferred is all-gathered once over each
group that was used and compared with the source rank's: every broadcast tensor must have arrived
bitwise equal. The detail carries the time spent in the target and the number of coalesced
broadcasts, for the before/after comparison.

Reads inside the target: while a target runs, a torch function mode watches every torch operation
(methods and properties included) for an argument whose memory overlaps a deferred tensor's; such an
operation (``model.load_state_dict(state_dict)`` at the end of a per-key loader, a ``copy_`` from
the received buffer) flushes every pending bucket first, so it sees the broadcast data. The flush is
a collective: it is safe when the ranks run the same code (they touch the same tensors at the same
point); a rank-local read (``if rank == 0: print(t.norm())``) flushes on that rank only and
mismatches the buckets.

Risk: what the mode cannot see still reads stale data: a read through another tensor object over
other memory that is later copied in, or through raw pointers (``data_ptr()`` in an extension).
Guarded two ways: with checks on (``moedoctor verify``), the receiving ranks' floating-point tensors
are filled with NaN when deferred, so a stale read poisons what it was copied into (the losses become
NaN and the loss comparison fails) instead of silently using old weights; and a tensor the source
rank modifies in place after deferring it without a torch operation the mode sees (its version
counter moves) is reported as a note, since the ranks would receive the later value. A loop that
reads each tensor right after its broadcast flushes every time: nothing is coalesced, and the verify
says the storm is still there. Code that needs the data before the function returns must not be a
target: name a smaller function (``--config``).
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from moedoctor.fixes.base import Fix, FixConfigError, parse_targets

NAME = "coalesce-broadcasts"
CHECK = "broadcast tensors bitwise equal to the source"
DEFAULT_BUCKET_MB = 500.0
#: The torch.distributed entry points that flush the pending buckets first (another collective).
OTHER_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def _parse_config(section: Mapping[str, Any]) -> dict:
    unknown = set(section) - {"targets", "bucket_mb"}
    if unknown:
        raise FixConfigError(f"unknown key(s) {sorted(unknown)}; expected 'targets' and 'bucket_mb'")
    out: dict[str, Any] = {"targets": parse_targets(section, "targets")}
    bucket = section.get("bucket_mb", DEFAULT_BUCKET_MB)
    if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not bucket > 0:
        raise FixConfigError(f"bucket_mb: expected a positive number of MB, got {bucket!r}")
    out["bucket_mb"] = float(bucket)
    return out


class Buckets:
    """Pending broadcasts, per (group, src, device) key, in issue order: torch-free, so that the
    bucketing is testable alone. ``add`` returns the key's full bucket to flush first, or None."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pending: dict[Any, list[Any]] = {}
        self.sizes: dict[Any, int] = {}

    def add(self, key: Any, item: Any, nbytes: int) -> list[Any] | None:
        """Queue ``item``; if it does not fit in its key's bucket, that bucket is returned (to flush
        before), and ``item`` starts a new one. An item larger than the limit is a bucket alone."""
        full = None
        if key in self.pending and self.sizes[key] + nbytes > self.limit:
            full = self.pending.pop(key)
            del self.sizes[key]
        self.pending.setdefault(key, []).append(item)
        self.sizes[key] = self.sizes.get(key, 0) + nbytes
        return full

    def drain(self) -> list[tuple[Any, list[Any]]]:
        """Every pending bucket, oldest key first, and forget them."""
        out = list(self.pending.items())
        self.pending.clear()
        self.sizes.clear()
        return out

    def __bool__(self) -> bool:
        return bool(self.pending)


class Ranges:
    """Byte ranges of the deferred tensors (start, end), for the overlap test of every torch
    operation inside a target: torch-free, testable alone. Deferred tensors are distinct buffers
    (a tensor broadcast twice flushes first), so the ranges do not overlap one another, and one
    bisection answers whether [start, end) meets any of them."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self.starts, end) - 1  # the last range starting before ``end``
        return i >= 0 and self.ends[i] > start

    def clear(self) -> None:
        self.starts.clear()
        self.ends.clear()

    def __bool__(self) -> bool:
        return bool(self.starts)


def _install(runtime) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    limit = int(float(runtime.config.get("bucket_mb", DEFAULT_BUCKET_MB)) * (1 << 20))
    checks = runtime.checks_enabled
    local = threading.local()
    original_broadcast = c10d.broadcast
    torch_dir = os.path.dirname(torch.__file__) + os.sep

    def _extent(tensor) -> tuple[int, int] | None:
        """[first byte, last byte + 1) of ``tensor``'s elements (a view's strided span), or None for a
        tensor without memory of its own to compare (meta, sparse, empty)."""
        try:
            if tensor.numel() == 0 or tensor.is_meta or tensor.layout is not torch.strided:
                return None
            start = tensor.data_ptr()
        except (RuntimeError, AttributeError):  # no storage (a tensor subclass, a sparse tensor)
            return None
        span = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        return start, start + (span + 1) * tensor.element_size()

    def state():
        if not hasattr(local, "depth"):
            local.depth, local.buckets, local.sent, local.flushes, local.deferred = 0, Buckets(limit), [], 0, 0
            local.ranges, local.touch_flushes, local.quiet = Ranges(), 0, False
        return local

    class FlushOnTouch(torch.overrides.TorchFunctionMode):
        """Inside a target: an operation on a deferred tensor's memory flushes the buckets first (the
        mode is off while its handler runs, so the flush's own operations pass straight through)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            s = state()
            if s.ranges and not s.quiet and _touches(s.ranges, args, kwargs):
                s.touch_flushes += 1
                flush_all()
            return func(*args, **(kwargs or {}))

    def _touches(ranges, args, kwargs) -> bool:
        stack = [args, kwargs] if kwargs else [args]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                extent = _extent(item)
                if extent is not None and ranges.overlaps(*extent):
                    return True
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, Mapping):
                stack.extend(item.values())
        return False

    def flush_one(key, items) -> None:
        s = state()
        quiet, s.quiet = s.quiet, True  # the flush's own reads of the deferred tensors
        try:
            _flush_one(key, items)
        finally:
            s.quiet = quiet

    def _flush_one(key, items) -> None:
        group, src, _device = key
        tensors = [t for t, _version in items]
        if dist.get_rank() == src:
            moved = [i for i, (t, version) in enumerate(items) if t._version != version]
            if moved:
                runtime.note(
                    f"{len(moved)} tensor(s) were modified in place after their broadcast was deferred: the "
                    "ranks received the later value (name a smaller target function)"
                )
        pg = group if group is not None else c10d._get_default_group()
        if hasattr(dist, "_broadcast_coalesced"):
            dist._broadcast_coalesced(pg, tensors, limit, dist.get_group_rank(pg, src))
        else:
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            by_dtype: dict[Any, list] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for same in by_dtype.values():
                flat = _flatten_dense_tensors(same)
                original_broadcast(flat, src=src, group=group)
                for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
                    t.copy_(value)
        s = state()
        s.flushes += 1
        if checks:
            s.sent.extend((key, t) for t in tensors)

    def flush_all() -> None:
        s = state()
        s.ranges.clear()
        for key, items in s.buckets.drain():
            flush_one(key, items)

    def deferring_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        s = state()
        # torch's own broadcasts (set_model_state_dict's per-key loop slices each result at once) are
        # never deferred: only the target's own calls, whose code the user named.
        library = s.depth and sys._getframe(1).f_code.co_filename.startswith(torch_dir)
        if s.depth == 0 or async_op or group_src is not None or src is None or library:
            if s.depth and s.buckets:
                flush_all()
            return original_broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
        key = (group, src, str(tensor.device))
        if checks and dist.get_rank() != src and tensor.is_floating_point():
            tensor.fill_(float("nan"))  # a stale read inside the target poisons what it copies into
        full = s.buckets.add(key, (tensor, tensor._version), tensor.numel() * tensor.element_size())
        s.deferred += 1
        if full is not None:
            flush_one(key, full)
        extent = _extent(tensor)
        if extent is not None:
            s.ranges.add(*extent)
        return None

    def flushing(name, original):
        def before_other_collective(*args, **kwargs):
            s = state()
            if s.depth and s.buckets:
                flush_all()
            return original(*args, **kwargs)

        before_other_collective.__wrapped__ = original
        return before_other_collective

    dist.broadcast = c10d.broadcast = deferring_broadcast
    for name in OTHER_COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is not None:
            wrapped = flushing(name, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)

    def make_coalescing(original, owner):
        if not callable(original):
            raise TypeError(f"{original!r} is not callable")

        def coalescing(*args, **kwargs):
            s = state()
            s.depth += 1
            outermost = s.depth == 1
            if outermost:
                s.sent, s.flushes, s.deferred, s.touch_flushes = [], 0, 0, 0
                started = time.perf_counter()
                mode = FlushOnTouch()
                mode.__enter__()
            try:
                return original(*args, **kwargs)
            finally:
                if outermost:
                    mode.__exit__(None, None, None)
                    flush_all()
                s.depth -= 1
                if outermost:
                    elapsed = time.perf_counter() - started
                    if checks:
                        _check_arrivals(runtime, s.sent, s.deferred, s.flushes, s.touch_flushes, elapsed, torch, dist)

        return coalescing

    for target in runtime.fix.all_targets(runtime.config):
        runtime.patch(target, make_coalescing)


def _check_arrivals(runtime, sent, deferred, flushes, touch_flushes, elapsed, torch, dist) -> None:
    """One all_gather per group of the per-tensor fingerprints; each rank compares with the source's."""
    early = f" ({touch_flushes} before an operation on a deferred tensor)" if touch_flushes else ""
    timing = f"{deferred:,} broadcasts in {flushes} coalesced broadcast(s){early}, {elapsed:.2f} s in the target"
    if not sent:
        runtime.check(CHECK, None, f"no broadcast was deferred ({elapsed:.2f} s in the target)")
        return
    groups: dict[Any, list] = {}
    for (group, src, device), t in sent:
        groups.setdefault((group, device), []).append((src, t))
    bad = 0
    for (group, _device), items in groups.items():
        sums = torch.stack([t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64).sum() for _, t in items])
        size = dist.get_world_size(group)
        gathered = [torch.empty_like(sums) for _ in range(size)]
        dist.all_gather(gathered, sums, group=group)  # a flush-free entry point by now: nothing pending
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        for i, (src, _) in enumerate(items):
            if not torch.equal(gathered[dist.get_group_rank(pg, src)][i], sums[i]):
                bad += 1
    if bad:
        runtime.check(CHECK, False, f"{bad} of {len(sent):,} tensors differ from the source rank's; {timing}")
    else:
        runtime.check(CHECK, True, f"all {len(sent):,} identical to the source rank's (checksums); {timing}")


FIX = Fix(
    name=NAME,
    patterns=("broadcast-storm",),
    summary="defer the broadcasts of a loading function into ~500 MB buckets, one coalesced broadcast each",
    mechanism="Wraps the target function: while it runs, synchronous dist.broadcast calls are queued per "
    "(group, src, device) and sent as one coalesced broadcast per bucket (dist._broadcast_coalesced, else "
    "flatten per dtype + one broadcast + copy back) when the bucket is full, before any other collective, "
    "before any torch operation on a deferred tensor's memory (a torch function mode while the target "
    "runs: load_state_dict after a per-key loop), and when the function returns.",
    risk="A read the mode cannot see (raw pointers, another tensor object copied in later) gets stale data; "
    "with checks on, receivers' float tensors are NaN-filled when deferred so such a read shows in the "
    "losses, and a tensor the source modifies in place after deferring it is reported. A rank-local read "
    "of a deferred tensor flushes on that rank only (the flush is a collective). The bucket's flatten "
    "buffer costs up to bucket_mb of memory per dtype while it is sent.",
    cost="one collective per bucket instead of one per tensor; a flatten copy of each bucket (with checks: "
    "one all_gather of one int64 per tensor per target call)",
    check="every deferred tensor's byte-sum fingerprint, all-gathered once per target call, equals the source "
    "rank's (bitwise arrival); the detail gives the time spent in the target",
    targets=(),
    install=_install,
    parse_config=_parse_config,
    config_help="targets: 'module:function' or a list (the function(s) whose broadcasts are coalesced); "
    "bucket_mb: bucket size in MB (default 500)",
    by_structure="the function at the storm's call site (the script's own, __main__:function)",
)
