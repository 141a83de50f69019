"""Read PyTorch Flight Recorder dumps into moedoctor's typed records.

A Flight Recorder dump is one file per rank: a pickle (``_dump_fr_trace``, the files written by
``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) or JSON (``_dump_fr_trace_json``),
holding ``version``, ``entries`` (the ring buffer of collectives), ``pg_config`` (group name ->
ranks) and ``pg_status`` (last enqueued / completed per group). The dump does not name its rank:
the rank is the number that ends the file name (``<prefix><rank>``). Pickles go through
``moedoctor.trace.safe_pickle``, never ``pickle.load``.

What the dumps cannot tell (phases, steps, evidence, call sites of JSON dumps, dropped entries,
absent ranks) is listed in ``FlightRecorderRun.incomplete``; damaged entries or files become
``problems`` and ``incomplete`` lines, never exceptions, when a folder is read. The format and its
quirks are described in ``docs/flight-recorder.md``. No torch here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import moedoctor
from moedoctor.events import CallSite, CollectiveEvent, Group, Phase, TraceHeader
from moedoctor.trace import safe_pickle
from moedoctor.trace.op_names import PROFILING_NAMES
from moedoctor.trace.reader import RankTrace, TraceError, short
from moedoctor.trace.schema import MAX_DIM, MAX_DIMS, MAX_STRING, MAX_TENSORS
from moedoctor.wording import rank_numbers

FORMAT_NAME = "pytorch-flight-recorder"
MAX_STACK = 8  # user frames kept per call site, as the recorder keeps
MAX_PROBLEMS = 20  # per rank; the rest are counted
SNIFF_BYTES = 4096
MAX_RANKS = 1 << 20  # a rank number beyond this is damage, not a job
#: Bounds on a loaded dump's structure, checked once before anything reads it (``_check_bounds``):
#: nesting depth, items in one list or dict, items in all, and the length of one string.
MAX_DEPTH = 32
MAX_ITEMS = 1 << 20
MAX_TOTAL_ITEMS = 1 << 24
MAX_DUMP_STRING = 1 << 20
#: The memory a dump may take while it is parsed, estimated before parsing (``_parse_budget``): the
#: file's bytes, its text (JSON), and per value the parser would build a slot and a small object
#: (``_VALUE_BYTES``; a string its header, ``_STRING_BYTES``, and its characters). A dump over it is
#: refused before anything is built, so any dump is read or refused within this plus the process.
MAX_PARSE_BYTES = 320 << 20
_VALUE_BYTES = 64
_STRING_BYTES = 56
_SCAN_CHUNK = 1 << 20
#: A complete JSON string (escapes included); what is left after removing them is structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)

#: Keys of a dump and of its entries; two of them in a file's first bytes mark it as a dump.
_DUMP_TOKENS = (
    b"entries",
    b"pg_config",
    b"pg_status",
    b"comm_lib_version",
    b"nccl_comm_state",
    b"collective_seq_id",
    b"profiling_name",
    b"record_id",
    b"process_group",
)
_TOP_KEYS = frozenset({"entries", "pg_config", "pg_status", "nccl_comm_state"})

_PEER = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")

#: c10 ScalarType names as the dumps spell them -> torch dtype names as moedoctor's traces do.
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Int": "int32",
    "Long": "int64",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "ComplexHalf": "complex32",
}

# Frames that are not user code: interpreter internals, the standard library, torch, moedoctor and
# typing_extensions (whose ``deprecated`` wrapper sits in c10d stacks).
_INTERNAL_FRAME = re.compile(
    r"^<"
    r"|/lib/python3\.\d+/(?!.*(site|dist)-packages/)"
    r"|(site|dist)-packages/(torch|moedoctor)/"
    r"|(site|dist)-packages/typing_extensions\.py$"
    r"|(^|/)torch/(distributed|nn|autograd|optim|utils|amp|_dynamo|_functorch|_C)/"
    r"|(^|/)moedoctor/(recorder|_bootstrap)/"
)


@dataclass
class FlightRecorderRun:
    """Every rank's dump of one job, as moedoctor traces, with what they cannot tell."""

    traces: list[RankTrace]
    incomplete: list[str] = field(default_factory=list)
    source: str = ""


@dataclass
class _Dump:
    """One file, loaded and checked at the top level."""

    path: Path
    rank: int
    encoding: str  # "pickle" or "json"
    raw: dict
    problems: list[str]


def is_flight_recorder_dir(path: Path) -> bool:
    """A folder holding at least one Flight Recorder dump (pickle or JSON), told by content."""
    path = Path(path)
    try:
        return path.is_dir() and any(_sniff(p) for p in _files(path))
    except OSError:
        return False


def read_flight_recorder(path: Path) -> FlightRecorderRun:
    """Read a folder of per-rank dumps, or one dump file.

    A folder: unreadable or damaged dumps become ``incomplete`` / ``problems`` lines and the other
    ranks are still read; ``TraceError`` only when it holds no dump at all. One file: ``TraceError``
    when it cannot be read as a dump."""
    path = Path(path)
    incomplete: list[str] = []
    named: set[int] = set()  # rank numbers in the names of dump files, readable or not
    if path.is_file():
        rank = _rank_from_name(path)
        dumps = [_load_dump(path, 0 if rank is None else rank)]
        if rank is None:
            dumps[0].problems.append(f"{path.name}: no rank number at the end of the file name; taken as rank 0")
    elif path.is_dir():
        dumps = []
        candidates = _candidates(path)
        if not candidates:
            raise TraceError(f"{path}: no PyTorch Flight Recorder dumps in this folder")
        named = {rank for _, rank in candidates if rank is not None}
        for file, rank in candidates:
            if rank is None:
                incomplete.append(f"{file.name}: a dump without a rank number at the end of its name; skipped")
                continue
            try:
                dumps.append(_load_dump(file, rank))
            except TraceError as e:
                incomplete.append(f"rank {rank}: dump unreadable ({e})")
        dumps = _one_per_rank(dumps, incomplete)
    else:
        raise TraceError(f"{path}: no such file or folder")
    return _build_run(dumps, incomplete, named)


# ---------------------------------------------------------------------------------------------
# Finding and loading files


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file())


def _sniff(path: Path) -> str | None:
    """``"pickle"`` or ``"json"`` when the file's first bytes look like a dump, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return None
    if sum(token in head for token in _DUMP_TOKENS) < 2:
        return None
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"
    if head.lstrip()[:1] == b"{":
        return "json"
    return None


_RANK_IN_NAME = re.compile(r"(\d+)$")
_SUFFIXES = (".pkl", ".pickle", ".json", ".bin", ".dump", ".fr")


def _rank_from_name(path: Path) -> int | None:
    name = path.name
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    m = _RANK_IN_NAME.search(name[-12:])
    rank = int(m.group(1)) if m else None
    return rank if rank is not None and rank < MAX_RANKS else None


def _prefix(path: Path) -> str:
    return re.sub(r"\d+(\.\w+)?$", "", path.name)


def _candidates(folder: Path) -> list[tuple[Path, int | None]]:
    """Files that are dumps by content, plus damaged files named like them (same prefix, a rank
    number) so that a truncated rank is reported rather than silently left out."""
    files = _files(folder)
    sniffed = [p for p in files if _sniff(p)]
    prefixes = {_prefix(p) for p in sniffed}
    chosen = [p for p in files if p in sniffed or (_prefix(p) in prefixes and _rank_from_name(p) is not None)]
    return [(p, _rank_from_name(p)) for p in chosen]


def _load_dump(path: Path, rank: int) -> _Dump:
    try:
        size = path.stat().st_size
        if size > safe_pickle.MAX_BYTES:
            raise TraceError(
                f"{path}: {size} bytes is larger than a Flight Recorder dump can be (at most {safe_pickle.MAX_BYTES})"
            )
        with open(path, "rb") as f:
            pickled = f.read(1) == b"\x80"
        if not pickled:
            _check_json_budget(path, size)  # streamed: nothing is built before the estimate fits
        elif 2 * size > MAX_PARSE_BYTES:
            raise TraceError(_over_budget(path, size, "pickle", 2 * size))
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror or e})") from None
    if pickled:
        encoding = "pickle"
        # Each opcode that pushes a value costs a slot and an object: counted while the opcodes are
        # checked, before the unpickler builds anything.
        raw = safe_pickle.loads(data, str(path), max_values=(MAX_PARSE_BYTES - 2 * size) // _VALUE_BYTES)
    else:
        encoding = "json"
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise TraceError(
                f"{path}: neither a pickle nor JSON Flight Recorder dump ({type(e).__name__}: {str(e)[:120]})"
            ) from None
    if not isinstance(raw, dict) or not _TOP_KEYS.intersection(k for k in raw if isinstance(k, str)):
        raise TraceError(f"{path}: not a Flight Recorder dump (no entries, pg_config or pg_status)")
    _check_bounds(raw, path)
    return _Dump(path, rank, encoding, raw, [])


def _over_budget(path: Path, size: int, encoding: str, estimate: int, detail: str = "") -> str:
    return (
        f"{path}: over {MAX_PARSE_BYTES >> 20} MiB to parse, refused unparsed (about {estimate >> 20} MiB: a "
        f"{encoding} dump of {size} bytes{detail}; larger than a Flight Recorder dump can be)"
    )


def _check_json_budget(path: Path, size: int) -> None:
    """Refuse a JSON dump whose parse would take more than ``MAX_PARSE_BYTES``, reading it in chunks
    of ``_SCAN_CHUNK`` (never whole): its bytes and its text, plus per value (a comma, ``[`` or ``{``
    outside strings) and per string their cost. A string longer than ``MAX_DUMP_STRING`` characters is
    refused there too. A 200 MB file of one 100M-item shape is refused on its size alone."""
    floor = 3 * size  # the bytes, the text, and the strings' characters at least (ASCII)
    if floor > MAX_PARSE_BYTES:
        raise TraceError(_over_budget(path, size, "JSON", floor))
    values = strings = 0
    ascii_only = True
    carry = b""
    with open(path, "rb") as f:
        while chunk := f.read(_SCAN_CHUNK):
            ascii_only = ascii_only and chunk.isascii()
            buf = carry + chunk
            structure, n = _JSON_STRING.subn(b"S", buf)
            strings += n
            quote = structure.find(b'"')  # an unterminated string: it goes on in the next chunk
            if quote >= 0:
                carry = buf[len(buf) - (len(structure) - quote) :]
                structure = structure[:quote]
                if len(carry) > 6 * MAX_DUMP_STRING + 2:  # \uXXXX: six bytes per character at most
                    raise TraceError(
                        f"{path}: a string of more than {MAX_DUMP_STRING} characters: not a Flight Recorder dump"
                    )
            else:
                carry = b""
            values += structure.count(b",") + structure.count(b"[") + structure.count(b"{")
            text = size if ascii_only else 4 * size
            estimate = size + 2 * text + values * _VALUE_BYTES + strings * _STRING_BYTES
            if estimate > MAX_PARSE_BYTES:
                raise TraceError(
                    _over_budget(path, size, "JSON", estimate, f" with at least {values} values and {strings} strings")
                )


def _check_bounds(raw: object, path: Path) -> None:
    """Refuse a dump whose structure is beyond what Flight Recorder writes: nested deeper than
    ``MAX_DEPTH``, a list or dict of more than ``MAX_ITEMS``, ``MAX_TOTAL_ITEMS`` in all, a string of
    more than ``MAX_DUMP_STRING``. Iterative, and each container is visited once, so a pickle whose
    memo makes a cycle or an exponentially large DAG (a 2 KB file) costs its size, not its expansion."""
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(raw, 1)]
    total = 0
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (str, bytes)):
            if len(value) > MAX_DUMP_STRING:
                raise TraceError(
                    f"{path}: a string of {len(value)} characters (over {MAX_DUMP_STRING}): not a Flight Recorder dump"
                )
            continue
        if not isinstance(value, (list, tuple, dict)) or id(value) in seen:
            continue
        seen.add(id(value))
        if depth > MAX_DEPTH:
            raise TraceError(f"{path}: nested deeper than {MAX_DEPTH} levels: not a Flight Recorder dump")
        if len(value) > MAX_ITEMS:
            raise TraceError(
                f"{path}: a {type(value).__name__} of {len(value)} items (over {MAX_ITEMS}): not a Flight Recorder dump"
            )
        total += len(value)
        if total > MAX_TOTAL_ITEMS:
            raise TraceError(f"{path}: more than {MAX_TOTAL_ITEMS} values: not a Flight Recorder dump")
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        for k, v in items:
            if isinstance(k, (str, bytes)) and len(k) > MAX_DUMP_STRING:
                raise TraceError(f"{path}: a key of {len(k)} characters: not a Flight Recorder dump")
            stack.append((v, depth + 1))


def _one_per_rank(dumps: list[_Dump], incomplete: list[str]) -> list[_Dump]:
    """One dump per rank: a pickle (it has frames) over JSON, then the one with more entries."""
    by_rank: dict[int, list[_Dump]] = {}
    for dump in dumps:
        by_rank.setdefault(dump.rank, []).append(dump)
    chosen = []
    for rank, group in sorted(by_rank.items()):
        group.sort(key=lambda d: (d.encoding != "pickle", -len(_as_list(d.raw.get("entries")))))
        if len(group) > 1:
            incomplete.append(
                f"rank {rank}: {len(group)} dumps ({', '.join(d.path.name for d in group)}); read {group[0].path.name}"
            )
        chosen.append(group[0])
    return chosen


# ---------------------------------------------------------------------------------------------
# Turning dumps into traces


def _build_run(dumps: list[_Dump], incomplete: list[str], named: set[int]) -> FlightRecorderRun:
    memberships = _group_ranks(dumps)
    world_size, world_known = _world_size(dumps, memberships, named)
    traces = [_trace(dump, memberships, world_size) for dump in dumps]
    ranks = sorted(d.rank for d in dumps)
    incomplete.extend(_what_is_missing(dumps, traces, ranks, world_size, world_known, memberships))
    encodings = "+".join(sorted({d.encoding for d in dumps})) or "no readable dump"
    count = f"{len(dumps)} of {world_size} ranks" if world_known else f"{len(dumps)} ranks, world size not stated"
    return FlightRecorderRun(traces=traces, incomplete=incomplete, source=f"flight recorder ({encodings}, {count})")


def _as_list(value) -> list:
    return value if isinstance(value, list) else []


def _as_dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _parse_ranks(value) -> tuple[int, ...] | None:
    """``pg_config`` ranks: a string like ``"[0, 1]"`` in the dumps, a list in some versions."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if isinstance(value, (list, tuple)) and all(
        isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANKS for r in value
    ):
        return tuple(value)
    return None


def _group_key(entry: dict) -> tuple[str, str] | None:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) == 2 and all(isinstance(x, str) for x in pg):
        return pg[0], pg[1]
    pg_id = entry.get("pg_id")
    if isinstance(pg_id, int) and not isinstance(pg_id, bool):
        return str(pg_id), ""
    return None


def _group_ranks(dumps: list[_Dump]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Group name -> (global ranks, how they were learnt: "pg_config" or "seen" in the entries)."""
    configured: dict[str, tuple[int, ...]] = {}
    seen: dict[str, set[int]] = {}
    for dump in dumps:
        entries = [e for e in _as_list(dump.raw.get("entries")) if isinstance(e, dict)]
        names = set()
        for entry in entries:
            key = _group_key(entry)
            if key:
                names.add(key[0])
                seen.setdefault(key[0], set()).add(dump.rank)
        for name, config in _as_dict(dump.raw.get("pg_config")).items():
            ranks = _parse_ranks(_as_dict(config).get("ranks"))
            if not ranks or not isinstance(name, str):
                continue
            if name == "":
                # Gloo (torch 2.13) files every group under the key "" and overwrites it: its ranks
                # belong to a group only when the dump knows a single one.
                if len(names) == 1:
                    configured.setdefault(next(iter(names)), ranks)
                continue
            configured.setdefault(name, ranks)
    result: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in set(configured) | set(seen):
        if name in configured:
            result[name] = (configured[name], "pg_config")
        else:
            result[name] = (tuple(sorted(seen[name])), "seen")
    return result


def _is_default_group(name: str, desc: str) -> bool:
    return name == "0" or desc == "default_pg"


def _world_size(dumps: list[_Dump], memberships, named: set[int]) -> tuple[int, bool]:
    """The world size, and whether a dump stated it (``pg_config`` of the default group "0")."""
    seen = max([d.rank for d in dumps] + list(named), default=-1) + 1
    configured = [max(ranks) + 1 for ranks, how in memberships.values() if how == "pg_config" and ranks]
    default_ranks, how = memberships.get("0", ((), ""))
    if how == "pg_config" and default_ranks:
        return max(max(default_ranks) + 1, seen), True
    return max(configured + [seen]), False


def _trace(dump: _Dump, memberships, world_size: int) -> RankTrace:
    raw = dump.raw
    version_text = raw.get("version")
    version_text = version_text if isinstance(version_text, str | int | float) else ""
    problems = dump.problems
    entries = raw.get("entries", [])
    if not isinstance(entries, list):
        problems.append(f"{dump.path.name}: 'entries' is a {type(entries).__name__}, not a list")
        entries = []
    groups: dict[str, Group] = {}
    events: list[CollectiveEvent] = []
    completed_upto = _last_completed(raw.get("pg_status"))
    bad = 0
    for index, entry in enumerate(entries):
        try:
            event = _event(entry, dump.rank, groups, memberships, world_size, completed_upto)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            bad += 1
            if bad <= MAX_PROBLEMS:
                problems.append(f"{dump.path.name}: malformed entry {index} ({type(e).__name__}: {str(e)[:120]})")
            continue
        events.append(event)
    if bad > MAX_PROBLEMS:
        problems.append(f"{dump.path.name}: {bad - MAX_PROBLEMS} more malformed entries")
    events.sort(key=lambda e: e.event_id)
    header = TraceHeader(
        format=FORMAT_NAME,
        version=_version_number(version_text),
        rank=dump.rank,
        local_rank=dump.rank,
        world_size=world_size,
        host=_text(raw.get("host")),
        pid=_int_or(raw.get("pid"), 0),
        torch_version=_text(raw.get("torch_version")),
        moedoctor_version=moedoctor.__version__,
        start_time=min((e.time for e in events), default=0.0),
    )
    return RankTrace(path=dump.path, header=header, events=events, groups=groups, problems=problems)


def _event(
    entry, rank: int, groups: dict[str, Group], memberships, world_size: int, completed_upto: dict[str, int]
) -> CollectiveEvent:
    if not isinstance(entry, dict):
        raise TypeError(f"an entry is a {type(entry).__name__}")
    key = _group_key(entry)
    if key is None:
        raise KeyError("process_group")
    name, desc = key
    group = groups.get(name)
    if group is None:
        ranks = memberships.get(name, ((), ""))[0]
        if _is_default_group(name, desc) and memberships.get(name, ((), ""))[1] != "pg_config":
            ranks = tuple(range(world_size))
        group = groups[name] = Group(name, desc, ranks)

    raw_op = entry["profiling_name"]
    if not isinstance(raw_op, str) or len(raw_op) > MAX_STRING:
        raise TypeError("profiling_name is not a string of at most 4096 characters")
    op, peer = normalize_op(raw_op)
    is_p2p = entry.get("is_p2p")
    is_p2p = op in ("send", "recv") if not isinstance(is_p2p, bool) else is_p2p
    seq = _count(entry.get("collective_seq_id", entry.get("seq_id")), "collective_seq_id")
    p2p_seq = _count(entry.get("p2p_seq_id"), "p2p_seq_id") if is_p2p else None
    if peer is not None and group.ranks and peer < len(group.ranks):
        peer = group.ranks[peer]  # profiling names count peers in group ranks
    record_id = _count(entry.get("record_id"), "record_id")
    created = entry.get("time_created_ns")
    time = created / 1e9 if isinstance(created, int | float) and not isinstance(created, bool) else 0.0
    return CollectiveEvent(
        rank=rank,
        event_id=record_id,
        time=time,
        group=group,
        seq=seq,
        op=op,
        raw_op=raw_op,
        in_shapes=_shapes(entry.get("input_sizes")),
        out_shapes=_shapes(entry.get("output_sizes")),
        dtypes=_dtypes(entry.get("input_dtypes")),
        reduce_op=None,
        async_op=False,
        thread=_text(entry.get("thread_name")),
        call_site=_call_site(entry.get("frames")),
        phase=Phase.OTHER,
        step=0,
        peer=peer if is_p2p else None,
        p2p_seq=p2p_seq,
        completed=_completed(entry, raw_op, time, completed_upto),
    )


def normalize_op(profiling_name: str) -> tuple[str, int | None]:
    """``"nccl:send 0->1"`` -> ``("send", 1)``; ``"gloo:broadcast"`` -> ``("broadcast", None)``.

    The peer is the number on the far side of the arrow, a rank of the op's group."""
    text = profiling_name.strip()
    base = text.split(":", 1)[1] if ":" in text else text
    base = base.strip()
    peer = None
    m = _PEER.search(base)
    if m:
        peer = int(m.group(3))
        base = base[: m.start()].strip()
    base = base.split()[0] if base.split() else base
    base = base.lower()
    return PROFILING_NAMES.get(base, base), peer


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DIM:
        raise ValueError(f"{what} is {short(value)}")  # never the repr of a container: it may be huge
    return value


def _shapes(value) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TENSORS:
        raise ValueError(
            f"sizes are {short(value)} of {len(value) if isinstance(value, (list, tuple)) else '?'} "
            f"items (at most {MAX_TENSORS})"
        )
    shapes = []
    for shape in value:
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
            raise ValueError(f"a shape is {short(shape)} (at most {MAX_DIMS} dimensions)")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape):
            raise ValueError(f"a shape holds a dimension that is not an int in 0..{MAX_DIM}")
        shapes.append(tuple(shape))
    return tuple(shapes)


def _dtypes(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TENSORS:
        raise TypeError(f"input_dtypes is {short(value)}")
    names = [_DTYPES.get(d, d.lower()) for d in value if isinstance(d, str) and len(d) <= 64]
    if len(names) != len(value):
        raise TypeError("input_dtypes holds a non-string")
    return tuple(dict.fromkeys(names))


def _call_site(frames) -> CallSite | None:
    """The first frame outside torch (frames are innermost first), and up to 8 user frames."""
    if not isinstance(frames, list):
        return None
    user = []
    for frame in frames:
        if not isinstance(frame, dict):
            continue
        file, line, fn = frame.get("filename"), frame.get("line"), frame.get("name")
        if not isinstance(file, str) or len(file) > MAX_STRING or _INTERNAL_FRAME.search(file):
            continue
        line = line if isinstance(line, int) and not isinstance(line, bool) else 0
        user.append((file, line, fn[:MAX_STRING] if isinstance(fn, str) else "?"))
        if len(user) == MAX_STACK:
            break
    if not user:
        return None
    file, line, fn = user[0]
    return CallSite(file, line, fn, tuple(f"{f}:{ln} {n}" for f, ln, n in user))


def _last_completed(pg_status) -> dict[str, int]:
    """pg_id -> last completed op id; JSON dumps write the numbers as strings."""
    result = {}
    for pg_id, status in _as_dict(pg_status).items():
        if not isinstance(pg_id, str | int):
            continue
        value = _as_dict(status).get("last_completed_collective")
        try:
            result[str(pg_id)] = int(value)
        except (TypeError, ValueError, OverflowError):
            continue
    return result


def _completed(entry: dict, raw_op: str, time: float, completed_upto: dict[str, int]) -> float | None:
    """When the collective completed, if the dump says it did.

    NCCL entries move to ``completed`` with a discovery time. Gloo entries stay ``scheduled``
    forever; for them ``pg_status`` (last completed op id of the group, keyed by ``pg_id``) or
    ``retired`` tells completion, and the time is unknown: the issue time stands in."""
    state = entry.get("state")
    if state == "completed":
        done = entry.get("time_discovered_completed_ns")
        ok = isinstance(done, int | float) and not isinstance(done, bool) and done > 0
        return done / 1e9 if ok else time
    if not raw_op.startswith("gloo:"):
        return None
    pg_id, op_id = entry.get("pg_id"), entry.get("op_id")
    last = completed_upto.get(str(pg_id))
    if last is not None and isinstance(op_id, int) and not isinstance(op_id, bool):
        return time if op_id <= last else None
    return time if entry.get("retired") is True else None


def _version_number(text) -> int:
    """``"2.10"`` -> 210 (major * 100 + minor); an int stays; anything else 0."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d{1,6})(?:\.(\d{1,6}))?.*", str(text))
    if not m:
        return 0
    return int(m.group(1)) * 100 + int(m.group(2) or 0)


def _version_text(value) -> str:
    return str(value)[:20] if isinstance(value, str | int | float) else "?"


def _text(value) -> str:
    return value[:MAX_STRING] if isinstance(value, str) else ""


def _int_or(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# ---------------------------------------------------------------------------------------------
# What the dumps cannot tell


def _what_is_missing(
    dumps: list[_Dump], traces: list[RankTrace], ranks: list[int], world_size: int, world_known: bool, memberships
) -> list[str]:
    notes = [
        "no phases, steps, FSDP module names or evidence (gradient norms, parameters without "
        "gradients, checkpoint phases): Flight Recorder records none of them",
        "reduce ops and async_op unknown: Flight Recorder does not record them",
    ]
    absent = [r for r in range(world_size) if r not in ranks]
    if absent:
        how = "stated by pg_config" if world_known else "inferred from the highest rank in the file names"
        notes.append(f"ranks without a dump: {_ranks_text(absent)} (world size {world_size}, {how})")
    if not world_known and dumps:
        notes.append(
            f"world size not stated by the dumps: {world_size} assumed from the file names; "
            "ranks after the highest-numbered file would go unnoticed"
        )
    json_ranks = [d.rank for d in dumps if d.encoding == "json"]
    if json_ranks:
        notes.append(f"no call sites for ranks {_ranks_text(json_ranks)}: JSON dumps carry no Python frames")
    no_frames = [
        t.rank
        for t, d in zip(traces, dumps)
        if d.encoding == "pickle" and t.events and all(e.call_site is None for e in t.events)
    ]
    if no_frames:
        notes.append(
            f"no call sites for ranks {_ranks_text(no_frames)}: the dumps hold no user frames "
            "(dumped without stack traces?)"
        )
    for trace in traces:
        ids = [e.event_id for e in trace.events]
        if ids and ids[0] > 0:
            first = trace.events[0]
            notes.append(
                f"rank {trace.rank}: ring buffer wrapped, {ids[0]} older entries dropped "
                f"(earliest kept: group {first.group.name} seq {first.seq}; raise TORCH_FR_BUFFER_SIZE)"
            )
    if any(e.raw_op.startswith("gloo:") for t in traces for e in t.events):
        notes.append(
            "Gloo: entries never leave 'scheduled'; completion is taken from pg_status / 'retired', "
            "completion times are unknown, and a dump taken right after a collective may show it not "
            "yet completed. Gloo records no send/recv or monitored_barrier, and records "
            "reduce_scatter_tensor as an all_reduce of the whole input"
        )
    inferred = sorted(name for name, (_, how) in memberships.items() if how == "seen")
    if inferred:
        notes.append(
            f"group ranks not in pg_config for groups {', '.join(inferred)}: taken from the ranks "
            "whose dumps mention them (the default group: every rank)"
        )
    versions = sorted({_version_text(d.raw.get("version")) for d in dumps})
    if len(versions) > 1:
        notes.append(f"dumps of mixed versions: {', '.join(versions)}")
    if dumps:
        notes.append("no host or pid: Flight Recorder dumps do not record them; ranks come from file names")
    return notes


_ranks_text = rank_numbers
