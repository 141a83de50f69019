"""The streaming path for large traces: never hold every event of every rank.

Pass 1 (one worker process per core, one rank file at a time): pull each collective's group and
signature out of the file with one regular expression (the recorder writes collective records in a
fixed key order), and hash the signatures per group in chunks of ``CHUNK`` sequence numbers. Only the
hashes, per-group counts and the few group / call-site definitions come back.

Between passes: for every group, the first chunk whose hashes differ across its members is where
the first divergence lies; when all common chunks agree, per-collective hashes of each group's last
``TAIL_RECORDS`` place it exactly (the usual hang: some members stopped earlier).

Pass 2: each rank loads, as typed records, only the byte ranges it needs: ``BEFORE`` sequence numbers
before the divergence (``BEFORE_MISSING`` where some members simply stopped) to ``AFTER`` past it,
for the groups that diverge, and the last ``TAIL`` bytes of its file (its final collectives,
completions, evidence). ``analyze`` then runs on these windows with the
exact last sequence numbers from pass 1, exactly as on a full load.

A rank file whose collective records do not all match the expected layout (hand-edited, damaged,
another writer) is loaded in full instead, and noted.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import chain, compress, islice, repeat
from operator import eq, itemgetter
from pathlib import Path

from moedoctor.analysis.loading.run_data import RunData
from moedoctor.analysis.loading.trace_files import TraceFolder, last_sequences, read_rank_trace
from moedoctor.trace import schema
from moedoctor.trace.reader import RankTrace, TraceError, TraceFile
from moedoctor.trace.op_names import CANONICAL_OPS


#: Sequence numbers per hash chunk.
CHUNK = 256
#: Sequence numbers loaded before a divergence (history for the culprit rules) and after it; before
#: the point where some members stopped (no history needed), fewer.
BEFORE, AFTER, BEFORE_MISSING = 512, 16, 64
#: Bytes loaded at the end of every file.
TAIL = 16 << 10
#: Collectives per group whose hashes are kept one by one (to place a divergence at the end exactly).
TAIL_RECORDS = 256
#: Bytes loaded past a window's last collective (its completions and annotations come a little later).
SLACK = 64 << 10

# One pass over the file: every record starts with {"k":"; collective records (keys in the order of
# moedoctor.trace.schema.COLLECTIVE, which both recorders follow) give their group, p2p sequence
# number and signature; group and call-site definitions are captured whole.
_RECORDS = re.compile(b"(?:" + schema.line_pattern("dt", ("g", "pseq", "op", "in", "dt")) + rb')|\{"k":"([gs]",[^\n]*)')
_P2P = re.compile(schema.line_pattern("peer", ("g", "pseq", "peer"), strings=("th", "mod")))
_CAP = schema.line_prefix(schema.CAP)
#: The cap record as the scan feeds it to the loader (its time and limit are not read from the scan).
_CAP_LINE = json.dumps(schema.fields(schema.CAP, time=0, limit=0), separators=(",", ":")).encode() + b"\n"
_DEFINITIONS = (schema.line_prefix(schema.GROUP), schema.line_prefix(schema.SITE))
_COLLECTIVE = schema.line_prefix(schema.COLLECTIVE)
_SIGNATURE = itemgetter(2, 3, 4)  # op, input shapes, dtypes: what CollectiveEvent.signature() compares


@dataclass
class GroupScan:
    gid: int
    name: str
    count: int
    first: int
    last: int
    hashes: list[bytes]  # one per CHUNK sequence numbers
    tail: list[bytes] = field(default_factory=list)  # one per collective, the last TAIL_RECORDS


@dataclass
class RankScan:
    path: str
    rank: int | None = None
    error: str | None = None
    fallback: str | None = None  # why this rank must be loaded in full
    definitions: list[bytes] = field(default_factory=list)
    groups: dict[str, GroupScan] = field(default_factory=dict)
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    p2p: dict[tuple[str, int], int] = field(default_factory=dict)
    size: int = 0


def scan_rank(path: str) -> RankScan:
    """Pass 1 for one file. Never raises: a problem is the scan's ``error`` or ``fallback``."""
    scan = RankScan(path=path)
    try:
        tf = TraceFile(path)
        scan.rank = tf.header.rank
        f = open(path, "rb")
    except (TraceError, OSError, ValueError) as e:
        scan.error = str(e)
        return scan
    with f:
        scan.size = os.fstat(f.fileno()).st_size
        try:
            # Mapped, not read: the regular expression runs over the page cache without a copy.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _scan(buf, scan)
        except Exception as e:  # noqa: BLE001 - anything odd: load this rank the exact way
            scan.fallback = f"unexpected layout ({type(e).__name__})"
    return scan


def _scan(buf, scan: RankScan) -> None:
    rows = _RECORDS.findall(buf)
    getgid, getdef, getpseq = itemgetter(0), itemgetter(5), itemgetter(1)
    gids: dict[int, tuple[str, tuple[int, ...]]] = {}
    for line in filter(None, map(getdef, rows)):
        scan.definitions.append(b'{"k":"' + line + b"\n")
        if line.startswith(b'g"'):
            rec = json.loads(scan.definitions[-1])
            gids[int(rec["id"])] = (str(rec["name"]), tuple(int(r) for r in rec["ranks"]))
    if _CAP in buf[max(0, len(buf) - TAIL) :]:
        scan.definitions.append(_CAP_LINE)
    if any(map(getpseq, rows)):  # p2p ops: counted per peer here, matched in the loaded windows
        for raw_gid, pseq, peer in _P2P.findall(buf):
            key = (gids[int(raw_gid)][0], int(peer))
            scan.p2p[key] = max(scan.p2p.get(key, 0), int(pseq))
        rows = [r for r in rows if not r[1]]
    ids = set(map(getgid, rows)) - {b""}
    ops = set(map(itemgetter(2), rows)) - {b""}
    if b"scatter" in ops:
        scan.fallback = "scatter ops (compared on their outputs)"
        return
    odd = sorted(op.decode("utf-8", "replace") for op in ops if op.decode("utf-8", "replace") not in CANONICAL_OPS)
    if odd:  # compared as written here: the exact load reads them as their canonical ops
        scan.fallback = f"op names outside the canonical ones ({', '.join(odd[:3])})"
        return
    for raw_gid in ids:
        gid = int(raw_gid)
        if gid not in gids:
            scan.fallback = f"collectives of undefined group id {gid}"
            return
        name = gids[gid][0]
        mine = compress(rows, map(eq, map(getgid, rows), repeat(raw_gid)))
        signatures = map(_SIGNATURE, mine)
        hashes: list = []
        count = 0
        recent: deque = deque(maxlen=TAIL_RECORDS // CHUNK + 1)
        while True:
            part = list(islice(signatures, CHUNK))
            if not part:
                break
            count += len(part)
            hashes.append(hashlib.blake2b(b"".join(chain.from_iterable(part)), digest_size=16).digest())
            recent.append(part)
        tail = [
            hashlib.blake2b(b"".join(sig), digest_size=8).digest()
            for sig in list(chain.from_iterable(recent))[-TAIL_RECORDS:]
        ]
        first, last = _seq_at(buf, gid, first=True), _seq_at(buf, gid, first=False)
        # Contiguous sequence numbers prove every record of the group matched the layout.
        if first != 1 or last - first + 1 != count:
            scan.fallback = f"group {name}: sequence numbers {first}..{last} for {count} records"
            return
        scan.groups[name] = GroupScan(gid, name, count, first, last, hashes, tail)
    for name, ranks in gids.values():
        scan.group_ranks[name] = ranks


def _seq_at(buf, gid: int, first: bool) -> int:
    """The first (or last) collective sequence number of a group in the file (p2p records skipped)."""
    needle = b'"g":%d,"seq":' % gid
    pos = buf.find(needle) if first else buf.rfind(needle)
    while pos >= 0:
        start = pos + len(needle)
        end = buf.find(b",", start)
        if buf[end : end + 5] == b',"s":':
            return int(buf[start:end])
        pos = buf.find(needle, pos + 1) if first else buf.rfind(needle, 0, pos)
    return 0


# ---- between the passes -------------------------------------------------------------------------


def divergence_windows(scans: list[RankScan]) -> dict[str, tuple[int, int]]:
    """Per group whose members' signature sequences differ: the range of sequence numbers to load.

    The first chunk whose hashes differ locates the divergence to within ``CHUNK``; when every
    chunk the members have in full agrees, the per-collective hashes of their last
    ``TAIL_RECORDS`` locate it exactly (the usual hang: some members stopped earlier)."""
    by_group: dict[str, list[GroupScan]] = {}
    members: dict[str, tuple[int, ...]] = {}
    ranks = {s.rank for s in scans}
    for s in scans:
        for name, ranks_ in s.group_ranks.items():
            members.setdefault(name, ranks_)
        for name, g in s.groups.items():
            by_group.setdefault(name, []).append(g)
    windows = {}
    for name, gs in by_group.items():
        traced = [r for r in members.get(name, ()) if r in ranks]
        if len(traced) > len(gs):  # members that never issued a collective on this group
            windows[name] = (1, CHUNK + AFTER)
            continue
        full = min(g.count for g in gs) // CHUNK
        first = next((i for i in range(full) if len({g.hashes[i] for g in gs}) > 1), None)
        if first is None:
            seq = _first_tail_difference(gs, full * CHUNK + 1)
            if seq is None:
                continue
            if seq > 0:
                missing = any(seq > g.count for g in gs)
                # Ranks that stopped early need no history; a mismatch does (the culprit rules
                # compare each rank with its own previous step).
                windows[name] = (max(1, seq - (BEFORE_MISSING if missing else BEFORE)), seq + AFTER)
                continue
            first = full
        windows[name] = (max(1, first * CHUNK + 1 - BEFORE), (first + 1) * CHUNK + AFTER)
    return windows


def _first_tail_difference(gs: list[GroupScan], start: int) -> int | None:
    """The first sequence number from ``start`` on where the members differ, by their last
    collectives' hashes: None if they never do, 0 if a member's tail does not reach back that far."""
    for seq in range(start, max(g.count for g in gs) + 1):
        seen = set()
        for g in gs:
            if seq > g.count:
                return seq  # this member never issued it
            pos = seq - (g.count - len(g.tail)) - 1
            if pos < 0:
                return 0
            seen.add(g.tail[pos])
        if len(seen) > 1:
            return seq
    return None


def _line_start(mm, pos: int) -> int:
    return mm.rfind(b"\n", 0, pos) + 1


def _ranges(path: str, scan: RankScan, windows: dict[str, tuple[int, int]]) -> list[tuple[int, int, frozenset | None]]:
    """Byte ranges of the rank's file to load, each with the group ids whose collectives to keep
    there (None: every record): each diverging group's window, and the tail."""
    size = scan.size
    ranges: list[tuple[int, int, frozenset | None]] = [(max(0, size - TAIL), size, None)]
    if not windows:
        return ranges
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name, (lo, hi) in windows.items():
            g = scan.groups.get(name)
            if g is None:
                continue
            lo, hi = max(lo, g.first), min(hi, g.last)
            if lo > hi:
                continue
            start = mm.rfind(b'"g":%d,"seq":%d,"s":' % (g.gid, lo))
            stop = mm.rfind(b'"g":%d,"seq":%d,"s":' % (g.gid, hi))
            if start < 0 or stop < 0:
                return [(0, size, None)]
            end = mm.find(b"\n", stop)
            ranges.append(
                (_line_start(mm, start), min(size, (end + 1 if end >= 0 else size) + SLACK), frozenset({g.gid}))
            )
    return _merge(ranges)


def _merge(ranges):
    out = []
    for lo, hi, keep in sorted(ranges, key=lambda r: (r[0], r[1])):
        if out and lo <= out[-1][1]:
            plo, phi, pkeep = out[-1]
            out[-1] = (plo, max(phi, hi), None if pkeep is None or keep is None else pkeep | keep)
        else:
            out.append((lo, hi, keep))
    return out


def load_ranges(path: str, definitions: list[bytes], ranges) -> tuple[RankTrace | None, list[str]]:
    """Pass 2 for one file: the records in ``ranges`` as a ``RankTrace`` (groups and call sites
    defined anywhere in the file are known; in a window, only its group's collectives are kept)."""
    try:
        tf = TraceFile(path)
    except (TraceError, OSError, ValueError) as e:
        return None, [f"{Path(path).name}: left out: {e}"]
    folder = TraceFolder(tf)
    for line in definitions:
        folder.feed(line, 0)
    with open(path, "rb") as f:
        header_end = len(f.readline())
        size = os.fstat(f.fileno()).st_size
        for lo, hi, keep in ranges:
            lo = max(lo, header_end)
            f.seek(lo - 1)
            if f.read(1) != b"\n":
                f.readline()  # start at a line boundary
            offset = f.tell()
            data = f.read(max(0, hi - offset))
            if offset + len(data) < size and not data.endswith(b"\n"):
                data += f.readline()
            for line in data.splitlines(keepends=True):
                at = offset
                offset += len(line)
                if line.startswith(_DEFINITIONS):
                    continue  # definitions were fed above
                if keep is not None and line.startswith(_COLLECTIVE) and _gid(line) not in keep:
                    continue
                if not folder.feed(line, at):
                    break
    trace = folder.finish()
    return trace, list(trace.problems)


def _gid(line: bytes) -> int | None:
    pos = line.find(b'"g":')
    end = line.find(b",", pos)
    try:
        return int(line[pos + 4 : end])
    except ValueError:
        return None


def _load_one(args) -> tuple[RankTrace | None, list[str]]:
    path, definitions, ranges = args
    return load_ranges(path, definitions, ranges)


def load_windowed(run: RunData, paths: list[Path], workers: int | None = None) -> None:
    """Fill ``run`` from ``paths`` through the two passes (``run.windowed`` set)."""
    workers = workers or max(1, min(len(paths), _usable_cpus()))
    names = [str(p) for p in paths]
    chunksize = max(1, len(names) // (workers * 8))
    with _pool(workers) as pool:
        scans = list(pool.map(scan_rank, names, chunksize=chunksize))
        good: list[RankScan] = []
        exact: list[str] = []
        for s in scans:
            if s.error:
                run.incomplete.append(f"{Path(s.path).name}: left out: {s.error}")
            elif s.fallback:
                run.incomplete.append(f"{Path(s.path).name}: {s.fallback}; read in full")
                exact.append(s.path)
            else:
                good.append(s)
        windows = divergence_windows(good)
        jobs = [
            (s.path, s.definitions, _ranges(s.path, s, {n: w for n, w in windows.items() if n in s.group_ranks}))
            for s in good
        ]
        for trace, notes in pool.map(_load_one, jobs, chunksize=chunksize):
            run.incomplete.extend(notes)
            if trace is not None:
                run.traces.append(trace)
    for s in good:
        run.last_seq[s.rank] = {name: g.last for name, g in s.groups.items()}
        for name in s.group_ranks:
            run.last_seq[s.rank].setdefault(name, 0)
        run.last_p2p[s.rank] = dict(s.p2p)
    for path in exact:
        trace = read_rank_trace(Path(path), run.incomplete)
        if trace is not None:
            run.traces.append(trace)
            seqs, p2p = last_sequences([trace])
            run.last_seq.update(seqs)
            run.last_p2p.update(p2p)
    run.windowed = True
    total = sum(s.size for s in scans)
    run.incomplete.append(
        f"streamed {len(scans)} trace files ({total / 2**20:.0f} MiB): every collective's signature was hashed and "
        f"compared; only the windows around divergences and each file's last {TAIL >> 10} KiB were loaded as records "
        "(evidence outside them is not shown)"
    )


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (taskset, cgroups' cpusets)
    except AttributeError:
        return os.cpu_count() or 1


class _InProcess:
    """The pool's interface, run here: for one worker, or where forking is unsafe."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items, chunksize=1):
        return map(fn, items)


def _pool(workers: int):
    import multiprocessing
    import threading

    # Forking a process that runs other threads (moedoctor run's readers, with --keep-alive) is
    # unsafe, and spawn would re-import the caller's __main__: work in this process instead.
    if workers <= 1 or threading.active_count() > 1 or "fork" not in multiprocessing.get_all_start_methods():
        return _InProcess()
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
