"""Slow, not stuck: where a job's collectives spent their time, and storms of small ones.

Pattern id ``broadcast-storm`` (the common case is a broadcast per parameter; any op is found).

Mechanism: a loader (FSDP2 full-state loading, ``sync_module_states``, an optimizer-state broadcast)
sends every tensor of a state dict with its own synchronous collective. Each call pays the
collective's fixed latency (a rendezvous of the ranks, a kernel launch or a TCP round trip) for a
few KB of data, so ten thousand of them take minutes while the link idles. Every collective
completes: the hang watchdog stays quiet and the job looks hung only to its owner.

Evidence (from the records alone, nothing added to the recorder): one rank's consecutive
collectives of one op, one group and one call site, at least ``MIN_STORM_COUNT`` of them, each
moving at most ``SMALL_BYTES`` on average, over at least ``MIN_STORM_SECONDS``. The time per
collective is the storm's span divided by its count (the calls are synchronous, so one starts when
the previous ended); it is compared with the time the same bytes would take at the bandwidth
measured on the largest collectives of the same rank (``_bandwidth``): latency-bound when the bytes
explain less than half of it.

Risk: the span between issues also holds whatever the loop does between calls (copying a tensor in,
reading a file): coalescing removes only the collectives' share. The estimate says so when the
bandwidth could not be measured (no collective of at least ``BANDWIDTH_MIN_BYTES`` in the trace).

Fix: ``coalesce-broadcasts`` (bucketed broadcasts, ~500 MB per bucket, as seed 000 did).

Thresholds, from the healthy fixtures (``fixtures/healthy_*`` under ``moedoctor run``, Gloo, 2
ranks): the longest run of consecutive collectives of one op and one call site is FSDP2's per-layer
all-gathers of one forward (under 20), so ``MIN_STORM_COUNT = 500`` is far from any of them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from moedoctor.analysis.evidence.source import calls_in, line_text, qualified_function
from moedoctor.events import CollectiveEvent
from moedoctor.wording import phase_label

#: A storm: at least this many consecutive collectives of one op, group and call site on a rank...
MIN_STORM_COUNT = 500
#: ... of at most this many bytes each on average (far below what fills a link: NCCL buckets are MBs) ...
SMALL_BYTES = 1 << 20
#: ... lasting at least this long (below, nobody waits for it).
MIN_STORM_SECONDS = 1.0
#: ``moedoctor run``'s status line says "slow, not stuck" once an ongoing storm lasts this long.
LIVE_STORM_SECONDS = 3.0
#: Bucket size of the coalesced estimate (``coalesce-broadcasts``'s default, the seed's 500 MB).
BUCKET_BYTES = 500 << 20
#: Collectives at least this large measure the bandwidth.
BANDWIDTH_MIN_BYTES = 1 << 20
#: Without such a collective, the stated model: bytes per second by device kind (conservative).
ASSUMED_BANDWIDTH = {"cpu": 1e9, "cuda": 50e9}

_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def event_bytes(e: CollectiveEvent) -> int:
    """Bytes one rank moves in one collective: the larger of its inputs and outputs."""

    def total(shapes: tuple[tuple[int, ...], ...]) -> int:
        n = 0
        for i, shape in enumerate(shapes):
            dtype = e.dtypes[min(i, len(e.dtypes) - 1)] if e.dtypes else "float32"
            n += math.prod(shape) * _ITEMSIZE.get(dtype, 4)
        return n

    return max(total(e.in_shapes), total(e.out_shapes))


def _site(e: CollectiveEvent) -> str | None:
    return None if e.call_site is None else e.call_site.where


def _key(e: CollectiveEvent) -> tuple:
    return (e.group.name, e.op, _site(e))


@dataclass(frozen=True, slots=True)
class Gain:
    """What coalescing the storm would save: ``coalesced_s`` estimated, ``gain_s`` = storm − that."""

    coalesced_s: float
    gain_s: float
    method: str
    weak: str | None = None  # why the estimate may be far off; None when measured


@dataclass(frozen=True, slots=True)
class Storm:
    """A run of consecutive small collectives of one op, group and call site (the longest rank's)."""

    op: str
    group: str
    call_site: str | None
    function: str | None
    phase: str
    steps: tuple[int, int]
    ranks: tuple[int, ...]
    count: int
    seconds: float
    bytes: int
    per_collective_s: float
    latency_bound: bool
    gain: Gain
    first_seq: int = 0

    @property
    def short_site(self) -> str:
        return "?" if self.call_site is None else self.call_site.rsplit("/", 1)[-1]

    def line(self) -> str:
        """``6,019 broadcasts from train.py:38 (load_full_state) in 11.2 s, 1.9 ms each, 24.1 MB: latency-bound``."""
        fn = f" ({self.function})" if self.function else ""
        kind = "latency-bound" if self.latency_bound else "not latency-bound"
        return (
            f"{self.count:,} {plural(self.op)} from {self.short_site}{fn} in {self.seconds:.1f} s, "
            f"{self.per_collective_s * 1e3:.2f} ms each, {megabytes(self.bytes)} in all, "
            f"phase {phase_label(self.phase)}: {kind}"
        )


@dataclass(frozen=True, slots=True)
class PhaseTiming:
    """Collectives of one phase and call site on one rank: count, first-to-last time, bytes."""

    rank: int
    phase: str
    call_site: str | None
    op: str
    count: int
    seconds: float
    bytes: int

    @property
    def mean_interval_s(self) -> float:
        return self.seconds / (self.count - 1) if self.count > 1 else 0.0


@dataclass
class SlowReport:
    """The "Slow, not stuck" section: storms first, then the time by phase of the rank that had them."""

    storms: list[Storm]
    phases: list[PhaseTiming] = field(default_factory=list)

    def summary(self) -> str:
        s = self.storms[0]
        more = f" (+{len(self.storms) - 1} more)" if len(self.storms) > 1 else ""
        return (
            f"slow, not stuck: {s.count:,} {plural(s.op)} from {s.short_site} in {seconds(s.seconds)} s"
            f"{' (latency-bound)' if s.latency_bound else ''}; coalescing would save about "
            f"{s.gain.gain_s:.1f} s{more}"
        )


def plural(op: str) -> str:
    return op + ("es" if op.endswith("h") else "s")


def seconds(x: float) -> str:
    """``1.5`` under ten seconds, ``38`` above."""
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


# ---- finding storms ------------------------------------------------------------------------------


def runs(events: list[CollectiveEvent]) -> list[list[CollectiveEvent]]:
    """One rank's events (in order) cut into maximal runs of one op, group and call site (p2p aside).
    A gap in the event ids (the streaming path loads windows of a large trace) ends a run too."""
    out: list[list[CollectiveEvent]] = []
    for e in events:
        if e.is_p2p:
            continue
        if out and _key(out[-1][-1]) == _key(e) and e.event_id == out[-1][-1].event_id + 1:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def _bandwidth(events: list[CollectiveEvent]) -> tuple[float, CollectiveEvent] | None:
    """Bytes per second of the fastest large collective of one rank: its duration is the earlier of
    its completion and the rank's next issue (a synchronous call ends before the next begins), an
    upper bound, so this bandwidth is a lower bound."""
    best: tuple[float, CollectiveEvent] | None = None
    for e, nxt in zip(events, events[1:] + [None]):
        size = event_bytes(e)
        if size < BANDWIDTH_MIN_BYTES:
            continue
        ends = [t for t in (e.completed, None if nxt is None else nxt.time) if t is not None and t > e.time]
        if not ends:
            continue
        rate = size / (min(ends) - e.time)
        if best is None or rate > best[0]:
            best = (rate, e)
    return best


def _gain(run: list[CollectiveEvent], seconds: float, size: int, bandwidth) -> tuple[Gain, bool]:
    count = len(run)
    per = seconds / count
    buckets = max(1, math.ceil(size / BUCKET_BYTES))
    if bandwidth is not None:
        rate, e = bandwidth
        how = (
            f"measured: {per * 1e3:.2f} ms per collective of the storm taken as the latency, "
            f"{rate / 1e9:.2f} GB/s from the fastest large collective ({e.op} of {megabytes(event_bytes(e))}"
            f"{' at ' + e.call_site.short if e.call_site else ''}), {buckets} bucket(s) of at most "
            f"{BUCKET_BYTES >> 20} MB"
        )
        weak = None
    else:
        kind = "cuda" if (run[0].device or "").startswith("cuda") else "cpu"
        rate = ASSUMED_BANDWIDTH[kind]
        how = (
            f"model: {per * 1e3:.2f} ms per collective taken as the latency, an assumed {rate / 1e9:.0f} GB/s "
            f"({kind}), {buckets} bucket(s) of at most {BUCKET_BYTES >> 20} MB"
        )
        weak = f"no collective of {BANDWIDTH_MIN_BYTES >> 20} MB or more in the trace to measure the bandwidth"
    transfer = size / rate
    latency_bound = transfer / count < 0.5 * per
    coalesced = min(seconds, buckets * per + transfer)
    if not latency_bound:
        weak = (weak + "; " if weak else "") + "the bytes explain most of the time: coalescing gains little"
    return Gain(coalesced, seconds - coalesced, how, weak), latency_bound


def rank_storms(rank: int, events: list[CollectiveEvent]) -> list[Storm]:
    """The storms of one rank's events (in issue order)."""
    bandwidth = _bandwidth(events)
    found = []
    for run in runs(events):
        if len(run) < MIN_STORM_COUNT:
            continue
        span = run[-1].time - run[0].time
        per = span / (len(run) - 1)
        seconds = per * len(run)
        size = sum(event_bytes(e) for e in run)
        if seconds < MIN_STORM_SECONDS or size / len(run) > SMALL_BYTES:
            continue
        gain, latency_bound = _gain(run, seconds, size, bandwidth)
        first = run[0]
        found.append(
            Storm(
                op=first.op,
                group=first.group.desc or first.group.name,
                call_site=_site(first),
                function=None if first.call_site is None else first.call_site.function,
                phase=first.phase.value,
                steps=(first.step, run[-1].step),
                ranks=(rank,),
                count=len(run),
                seconds=seconds,
                bytes=size,
                per_collective_s=per,
                latency_bound=latency_bound,
                gain=gain,
                first_seq=first.seq,
            )
        )
    return found


def phase_timing(rank: int, events: list[CollectiveEvent]) -> list[PhaseTiming]:
    """Per phase and call site of one rank: count, first-to-last issue time, bytes; largest time first."""
    acc: dict[tuple, list] = {}
    for e in events:
        key = (e.phase.value, _site(e), e.op)
        a = acc.setdefault(key, [0, e.time, e.time, 0])
        a[0] += 1
        a[2] = e.time
        a[3] += event_bytes(e)
    rows = [PhaseTiming(rank, k[0], k[1], k[2], a[0], a[2] - a[1], a[3]) for k, a in acc.items()]
    return sorted(rows, key=lambda p: -p.seconds)


def slow_report(traces) -> SlowReport | None:
    """Storms over every rank's trace (``RankTrace``s), merged across ranks; None when there is none."""
    merged: dict[tuple, Storm] = {}
    for t in traces:
        for s in rank_storms(t.header.rank, t.events):
            key = (s.group, s.op, s.call_site, s.first_seq)
            old = merged.get(key)
            if old is None or s.seconds > old.seconds:
                ranks = tuple(sorted(set(s.ranks) | set(old.ranks if old else ())))
                merged[key] = Storm(**{**_fields(s), "ranks": ranks})
            else:
                merged[key] = Storm(**{**_fields(old), "ranks": tuple(sorted(set(old.ranks) | set(s.ranks)))})
    if not merged:
        return None
    storms = sorted(merged.values(), key=lambda s: -s.seconds)
    rank = storms[0].ranks[0]  # any rank of the worst storm: its ranks move in lockstep
    events: list[CollectiveEvent] = next((t.events for t in traces if t.header.rank == rank), [])
    return SlowReport(storms, phase_timing(rank, events)[:8])


def storm_fix_config(slow: SlowReport | None, command: list[str] | None) -> dict | None:
    """``{"coalesce-broadcasts": {"targets": [...]}}`` for the latency-bound broadcast storms whose
    call site's function can be named as a fix target: a function of the job's script
    (``__main__:function``) or of an installed package (``package.module:function``); None otherwise."""
    if slow is None:
        return None
    script = next((os.path.normpath(a) for a in command or () if a.endswith(".py")), None)
    targets = []
    for s in slow.storms:
        if not (s.latency_bound and s.op == "broadcast" and s.call_site and s.function):
            continue
        if not s.function.isidentifier():  # <module>, <lambda>: nothing to wrap
            continue
        if direct_call(s) is False:  # a library call issues them (and may read each result at once)
            continue
        path, _, line = s.call_site.rpartition(":")
        file = os.path.normpath(path)
        module = None
        if script is not None and (file == script or file.endswith(os.sep + script.lstrip("." + os.sep))):
            module = "__main__"
        elif "-packages" + os.sep in file and file.endswith(".py"):
            module = file.split("-packages" + os.sep, 1)[1][:-3].replace(os.sep, ".").removesuffix(".__init__")
        # A method is patched as Class.method; a source that cannot be read keeps the plain name.
        name = s.function
        if line.isdigit():
            qualified = qualified_function(file, int(line), s.function)
            if qualified is None and line_text(file, int(line)) is not None:
                continue  # read, but not a function a fix can patch (one defined inside another)
            name = qualified or name
        if module is not None and f"{module}:{name}" not in targets:
            targets.append(f"{module}:{name}")
    return {"coalesce-broadcasts": {"targets": targets}} if targets else None


def direct_call(s: Storm) -> bool | None:
    """Does the job's line at the storm's call site call ``broadcast(...)`` itself (True), or a
    library function that broadcasts inside (False: ``set_model_state_dict(...)``, which slices each
    tensor right after its broadcast, so deferring its broadcasts would read stale data)? None: the
    source cannot be read here."""
    if s.call_site is None:
        return None
    file, _, line = s.call_site.rpartition(":")
    if not line.isdigit() or line_text(file, int(line)) is None:
        return None
    return bool(calls_in(file, int(line), s.op))


def _fields(s: Storm) -> dict:
    return {name: getattr(s, name) for name in Storm.__slots__}


# ---- while the job runs ------------------------------------------------------------------------


@dataclass
class StormWatch:
    """Fed one rank's collectives as they are read (``runner.progress``): the run going on now."""

    key: tuple | None = None
    count: int = 0
    first: float = 0.0
    last: float = 0.0
    bytes: int = 0
    op: str = ""
    site: str | None = None

    def feed(self, e: CollectiveEvent) -> None:
        if e.is_p2p:
            return
        key = _key(e)
        if key != self.key:
            self.key, self.count, self.first, self.bytes = key, 0, e.time, 0
            self.op = e.op
            self.site = None if e.call_site is None else e.call_site.short
        self.count += 1
        self.last = e.time
        self.bytes += event_bytes(e)

    @property
    def seconds(self) -> float:
        return self.last - self.first

    def line(self) -> str | None:
        """``slow, not stuck: 4,212 broadcasts from loader.py:88 in 38 s (latency-bound)``, or None."""
        seconds = self.seconds
        if self.count < MIN_STORM_COUNT or seconds < LIVE_STORM_SECONDS or self.bytes / self.count > SMALL_BYTES:
            return None
        return (
            f"slow, not stuck: {self.count:,} {plural(self.op)} from {self.site or '?'} in {seconds:.0f} s "
            f"({megabytes(self.bytes / self.count)} each: latency-bound)"
        )
