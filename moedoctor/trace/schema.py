"""The trace format's one definition: the records' kinds, their keys in the order writers put them,
the type of each value, and the attribute of ``moedoctor.events`` it becomes.

Everything else derives from the tables below:

- the Python recorder writes a collective with ``encode_collective`` (generated from ``COLLECTIVE``
  when this module is imported, so the hot path stays one f-string);
- the reader turns a record into a ``CollectiveEvent`` with ``decode_collective``, type-checked by
  the same table (a damaged or hostile record raises; the reader notes it and goes on);
- the test factory writes records with ``record_of``;
- the streaming scanners (``analysis.loading.scan``, ``trace.fr_completion``) match collective lines with
  regular expressions built by ``line_pattern`` from the key order;
- every other record is written from ``fields`` (``recorder/records.py``, ``recorder/exceptions.py``);
- the C++ kernel (``recorder/native/kernel.cpp``) cannot import it: it includes the header
  ``cpp_header`` generates at each of its builds (every key a macro), and ``problems`` checks any
  record against the tables (the native kernel's test runs it on every record kind the kernel writes);
- ``markdown`` prints the tables of ``docs/trace-format.md`` (a test keeps them equal).

To add a key to a record: a ``Key`` line here (and, when the typed record keeps it, the field it
fills), the value where it is produced (for the collective record also in the C++ writer, after its
``MDK_`` macro), and the code that uses it. Renaming a key on the wire: here only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moedoctor.events import CallSite, CollectiveEvent, Group, Phase
from moedoctor.trace.op_names import CANONICAL_OPS, canonical_op

FORMAT_NAME = "moedoctor-trace"
FORMAT_VERSION = 1

#: Bounds on what a record may claim: beyond them it is damage (or hostile), not a job.
MAX_WORLD_SIZE = 1 << 20
#: Longest string field kept in a record (op names, threads, files, group names).
MAX_STRING = 4096
#: Per collective record: tensors per list, dimensions per shape, and the size of one dimension.
MAX_TENSORS = 4096
MAX_DIMS = 64
MAX_DIM = (1 << 63) - 1


# ---- value types ----------------------------------------------------------------------------------


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str(x) -> bool:
    return isinstance(x, str) and len(x) <= MAX_STRING


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ints(x) -> bool:
    return isinstance(x, list) and len(x) <= MAX_WORLD_SIZE and all(_int(i) for i in x)


class _Memo:
    """Values that repeat (shapes, dtype lists) are checked once: ``convert`` turns the JSON list into
    a tuple cheaply (TypeError when it cannot), ``valid`` checks a tuple not seen before."""

    def __init__(self, convert: Callable[[Any], tuple], valid: Callable[[tuple], bool], size: int):
        self._convert, self._valid, self._size = convert, valid, size
        self._good: set[tuple] = set()

    def __call__(self, value) -> tuple:
        if not isinstance(value, list):
            raise TypeError("not a list")
        out = self._convert(value)
        if out in self._good:
            return out
        if not self._valid(out):
            raise TypeError("value of the wrong type")
        if len(self._good) < self._size:
            self._good.add(out)
        return out


def _shapes_ok(x: tuple) -> bool:
    return len(x) <= MAX_TENSORS and all(
        isinstance(s, tuple) and len(s) <= MAX_DIMS and all(_int(d) and 0 <= d <= MAX_DIM for d in s) for s in x
    )


def _as_shapes(x: list) -> tuple:
    return tuple(tuple(s) if isinstance(s, list) else s for s in x)


def _strs_ok(x: tuple) -> bool:
    return len(x) <= MAX_TENSORS and all(_str(s) for s in x)


def _checked(test: Callable[[Any], bool]) -> Callable[[Any], Any]:
    def convert(value):
        if not test(value):
            raise TypeError("value of the wrong type")
        return value

    return convert


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


def _splits(value) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not (isinstance(value, list) and len(value) == 2 and _ints(value[0]) and _ints(value[1])):
        raise TypeError("splits of the wrong type")
    return tuple(value[0]), tuple(value[1])


def _bool(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError("not a boolean")
    return value


@dataclass(frozen=True)
class Type:
    """A value type: its name in the docs, and what turns the JSON value into the typed one (raising
    TypeError or ValueError when the value is not of the type). References (group, site) are resolved
    by the reader, which knows the file's definitions."""

    name: str
    decode: Callable[[Any], Any]


INT = Type("int", _checked(_int))
COUNT = Type("int >= 0", _checked(lambda x: _int(x) and x >= 0))
OPT_INT = Type("int or null", _optional(_checked(_int)))
NUMBER = Type("number", _checked(_num))
STR = Type("str", _checked(_str))
BOOL = Type("bool", _bool)
SHAPES = Type("list of shapes (lists of int)", _Memo(_as_shapes, _shapes_ok, 100_000))
STRS = Type("list of str", _Memo(tuple, _strs_ok, 10_000))
INTS = Type("list of int", _checked(_ints))
RANKS = Type("list of global ranks", _checked(lambda x: _ints(x) and all(0 <= r < MAX_WORLD_SIZE for r in x)))
SPLITS = Type("[list of int, list of int]", _splits)
PHASE = Type("phase", Phase)
GROUP_REF = Type("group id", _checked(_int))
SITE_REF = Type("call-site id or null", _optional(_checked(_int)))
ANY = Type("JSON value", lambda value: value)


def _ids(value) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [value]
    if not (len(ids) <= 1 << 20 and all(_int(i) for i in ids)):
        raise TypeError("event ids of the wrong type")
    return tuple(ids)


def _coverage_groups(value) -> tuple[tuple[str, int, int | None], ...]:
    if not (isinstance(value, list) and len(value) <= MAX_WORLD_SIZE):
        raise TypeError("coverage groups of the wrong type")
    out = []
    for item in value:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and _str(item[0])
            and _int(item[1])
            and (item[2] is None or _int(item[2]))
        ):
            raise TypeError("coverage group of the wrong type")
        out.append((item[0], item[1], item[2]))
    return tuple(out)


#: Exception records: longest message kept, and most traceback frames kept (the outermost
#: ``MAX_FRAMES_OUTER`` and the innermost rest; ``cut`` counts those left out between).
MAX_MESSAGE = 2000
MAX_FRAMES = 64
MAX_FRAMES_OUTER = 8


def _frames(value) -> tuple[tuple[str, int, str], ...]:
    if not (isinstance(value, list) and len(value) <= MAX_FRAMES):
        raise TypeError("frames of the wrong type")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3 and _str(item[0]) and _int(item[1]) and _str(item[2])):
            raise TypeError("frame of the wrong type")
        out.append((item[0], item[1], item[2]))
    return tuple(out)


def _checkpointed(value) -> tuple[str, str, int, str, tuple[str, ...]]:
    if not (
        isinstance(value, list)
        and len(value) == 5
        and _str(value[0])
        and _str(value[1])
        and _int(value[2])
        and _str(value[3])
        and isinstance(value[4], list)
        and len(value[4]) <= MAX_FRAMES
        and all(_str(v) for v in value[4])
    ):
        raise TypeError("checkpointed function of the wrong type")
    return value[0], value[1], value[2], value[3], tuple(value[4])


FRAMES = Type(f"list of [file, line, function] (at most {MAX_FRAMES})", _frames)
CHECKPOINTED = Type("[function, file, line, module class, list of str]", _checkpointed)
MESSAGE = Type(
    f"str (at most {MAX_MESSAGE} characters)", _checked(lambda x: isinstance(x, str) and len(x) <= MAX_MESSAGE)
)

IDS = Type("list of event ids (or one)", _ids)
COVERAGE_GROUPS = Type("list of [name, recorded, backend or null]", _coverage_groups)
OPT_STR = Type("str or null", _optional(_checked(_str)))
OBJECT = Type("object", _checked(lambda x: isinstance(x, dict)))


@dataclass(frozen=True)
class Key:
    """One key of a record: on the wire ``key``; ``name`` is the typed record's attribute it fills
    (``None``: read and checked, not kept) and the Python writer's parameter."""

    key: str
    name: str
    type: Type
    required: bool = True
    doc: str = ""


@dataclass(frozen=True)
class Record:
    kind: str  # the value of "k"
    title: str
    keys: tuple[Key, ...]

    def key(self, key: str) -> Key:
        return next(k for k in self.keys if k.key == key)


GROUP = Record(
    "g",
    "process group definition",
    (
        Key("id", "id", INT, doc="this file's id for the group"),
        Key("name", "name", STR, doc="the process group's `group_name`, which agrees across ranks"),
        Key("desc", "desc", STR, required=False, doc="its `group_desc` (`default_pg`, ...)"),
        Key("ranks", "ranks", RANKS, doc="global ranks in group-rank order"),
    ),
)

SITE = Record(
    "s",
    "call site definition",
    (
        Key("id", "id", INT, doc="this file's id for the call site"),
        Key("file", "file", STR, doc="the first frame outside torch, moedoctor and the standard library"),
        Key("line", "line", INT),
        Key("fn", "function", STR),
        Key(
            "stack",
            "stack",
            STRS,
            required=False,
            doc="up to 8 such frames outward from it, innermost first, as `file:line function`",
        ),
    ),
)

COLLECTIVE = Record(
    "c",
    "a collective or p2p op, written before it is issued",
    (
        Key("i", "event_id", COUNT, doc="event id, per file, from 0"),
        Key("g", "group", GROUP_REF, doc="the group's id (a `g` record before it)"),
        Key(
            "seq",
            "seq",
            COUNT,
            doc="per-group collective sequence number kept by moedoctor, from 1. P2P ops do not "
            "advance it: they carry the number of collectives before them",
        ),
        Key("pseq", "p2p_seq", INT, required=False, doc="p2p only: sequence number per (group, peer) pair, from 1"),
        Key(
            "s",
            "call_site",
            SITE_REF,
            doc="the call site's id (`null` when no frame is outside torch, e.g. an autograd device thread)",
        ),
        Key("t", "time", NUMBER, doc="Unix time issued"),
        Key(
            "op",
            "op",
            STR,
            doc="canonical (`trace/op_names.py`: every backend's and API's spelling maps there): `all_reduce`, "
            "`all_gather`, `reduce_scatter`, `broadcast`, `barrier`, "
            "`all_to_all`, `gather`, `scatter`, `reduce`, `send`, `recv`, `monitored_barrier`, "
            "`all_reduce_coalesced`, `all_gather_coalesced`, `reduce_scatter_coalesced`",
        ),
        Key(
            "raw",
            "raw_op",
            STR,
            doc="the dispatcher op, e.g. `c10d::_reduce_scatter_base_`, `_c10d_functional::all_reduce`",
        ),
        Key("in", "in_shapes", SHAPES, doc="shapes of the input tensors (at most 64; `n` then gives the real counts)"),
        Key("out", "out_shapes", SHAPES, doc="shapes of the output tensors (at most 64)"),
        Key("dt", "dtypes", STRS, doc="distinct input dtypes, in order"),
        Key("async", "async_op", BOOL, doc="the caller did not wait (c10d `async_op`, or any functional collective)"),
        Key("th", "thread", STR, doc="thread name"),
        Key(
            "ph",
            "phase",
            PHASE,
            doc="phase: `forward`, `backward`, `optimizer`, `checkpoint_save`, `checkpoint_load`, `other`",
        ),
        Key("step", "step", INT, doc="optimizer steps completed so far (steps of the first optimizer that stepped)"),
        Key(
            "red",
            "reduce_op",
            STR,
            required=False,
            doc="reduce op (`sum`, `avg`, `max`, ...): inline from the native kernel and for functional collectives; "
            "the Python kernels give a c10d collective's in an `a` record",
        ),
        Key("n", "counts", INTS, required=False, doc="`[inputs, outputs]`: the real tensor counts, when over 64"),
        Key(
            "sp",
            "splits",
            SPLITS,
            required=False,
            doc="`all_to_all_single` only: `[input_split_sizes, output_split_sizes]`, rows sent to and received from "
            "each group member in group-rank order (`[]`: equal splits)",
        ),
        Key(
            "root",
            "root",
            OPT_INT,
            required=False,
            doc="rooted ops (`broadcast`, `reduce`, `gather`, `scatter`): the root's global rank (added in 0.1.1; "
            "absent in older traces)",
        ),
        Key(
            "mod",
            "module",
            STR,
            required=False,
            doc="fully qualified name of the FSDP2 unit whose hook issued it, when one did",
        ),
        Key("peer", "peer", INT, required=False, doc="p2p only: the peer's global rank"),
        Key(
            "dev",
            "device",
            STR,
            required=False,
            doc="device of the first input tensor, as torch prints it (`cpu`, `cuda:0`); absent without one "
            "(added in 0.1.2)",
        ),
    ),
)

DONE = Record(
    "d",
    "completions",
    (
        Key("t", "time", NUMBER, doc="Unix time of the poll that saw them complete"),
        Key("i", "event_ids", IDS, doc="event ids (a list, or one int)"),
        Key("src", "source", STR, required=False, doc="`fr`: proven from Flight Recorder, not a `Work`"),
    ),
)

ANNOTATE = Record(
    "a",
    "annotation of an earlier collective",
    (
        Key("i", "event_id", INT, doc="the collective's event id"),
        Key("red", "reduce_op", OPT_STR, doc="its reduce op, or `null` when unknown"),
    ),
)

EVIDENCE = Record(
    "e",
    "evidence",
    (
        Key("t", "time", NUMBER),
        Key("kind", "kind", STR),
        Key("step", "step", INT),
        Key("data", "data", OBJECT, required=False),
    ),
)

COVERAGE = Record(
    "v",
    "coverage",
    (
        Key("t", "time", NUMBER),
        Key("reason", "reason", STR),
        Key("groups", "groups", COVERAGE_GROUPS, doc="`[name, recorded, backend]` per process group"),
        Key("dropped", "dropped", COUNT, required=False),
        Key(
            "kernel",
            "kernel",
            STR,
            required=False,
            doc="the kernel whose counters gave `recorded`: `python` or `native`; absent in older traces",
        ),
    ),
)

CAP = Record("cap", "event cap reached", (Key("t", "time", NUMBER), Key("limit", "limit", INT)))
EXCEPTION = Record(
    "x",
    "an exception nothing caught (written by `sys.excepthook` / `threading.excepthook`, then flushed)",
    (
        Key("t", "time", NUMBER, doc="Unix time the hook ran"),
        Key(
            "type",
            "type",
            STR,
            doc="the exception's class with its module, e.g. `torch.utils.checkpoint.CheckpointError`",
        ),
        Key("msg", "message", MESSAGE, doc=f"`str()` of the exception, cut to {MAX_MESSAGE} characters"),
        Key(
            "tb",
            "frames",
            FRAMES,
            doc=f"the traceback's frames, outermost first; over {MAX_FRAMES}, the outermost {MAX_FRAMES_OUTER} "
            "and the innermost rest are kept",
        ),
        Key("cut", "frames_left_out", COUNT, required=False, doc="frames left out between those kept"),
        Key("th", "thread", STR, doc="thread name"),
        Key(
            "ph",
            "phase",
            PHASE,
            doc="phase, read from the traceback (autograd's engine: `backward`; an optimizer's `step`: "
            "`optimizer`; a module call: `forward`), else the recorder's",
        ),
        Key("step", "step", INT, doc="optimizer steps completed so far"),
        Key(
            "ckpt",
            "checkpointed",
            CHECKPOINTED,
            required=False,
            doc="when the traceback passes through `torch.utils.checkpoint` with its frame object at hand: the "
            'function it checkpointed, `[qualified name, file, first line, class of its module or "", module lists]`; '
            "module lists: `name:count` of each `nn.ModuleList` in that module whose members (at least 2) are of one "
            "class (experts), and `name.{p,q}:count` of each submodule holding its members stacked (at least 2 "
            "parameters of its own of 3+ dimensions sharing a leading one of 2+: fused experts), at most 64",
        ),
    ),
)


HEADER = Record(
    "",
    "header (first line)",
    (
        Key("format", "format", STR, doc='always `"moedoctor-trace"`'),
        Key("version", "version", INT, doc="`1`; a reader rejects versions it does not know, and folders mixing them"),
        Key("rank", "rank", INT, doc="of this process in the default group"),
        Key("local_rank", "local_rank", INT, doc="on its host"),
        Key("world_size", "world_size", INT, doc="of the default group"),
        Key("host", "host", STR, doc="where the rank runs"),
        Key("pid", "pid", INT, doc="its process id"),
        Key("torch", "torch_version", STR, doc="torch's version"),
        Key("moedoctor", "moedoctor_version", STR, doc="moedoctor's version"),
        Key("start_time", "start_time", NUMBER, doc="Unix time the trace was opened (at `init_process_group`)"),
        Key(
            "kernel",
            "kernel",
            STR,
            required=False,
            doc="the kernel recording this rank's collectives when the trace was opened: `python` or `native` "
            "(`--recorder auto` falls back to `python` where the native one cannot be built); absent in older traces",
        ),
    ),
)

RECORDS = {r.kind: r for r in (GROUP, SITE, COLLECTIVE, DONE, ANNOTATE, EVIDENCE, COVERAGE, CAP, EXCEPTION)}


# ---- reading ----------------------------------------------------------------------------------------


def decode(record: Record, rec: dict) -> dict[str, Any]:
    """The values of one record of kind ``record`` by attribute name, each type-checked (references
    left as ids). Raises KeyError for a missing key, TypeError or ValueError for a wrong value."""
    values: dict[str, Any] = {}
    for k in record.keys:
        if k.key in rec:
            values[k.name] = k.type.decode(rec[k.key])
        elif k.required:
            raise KeyError(f"{record.kind} record without {k.key!r}")
    return values


_C_DECODE = {k.key: (k.name, k.type.decode) for k in COLLECTIVE.keys}
_C_REQUIRED = frozenset(k.key for k in COLLECTIVE.keys if k.required)
#: An optional key left out is None in the typed record.
_C_ABSENT = {k.name: None for k in COLLECTIVE.keys if not k.required and k.name in CollectiveEvent.__dataclass_fields__}


def decode_collective(rec: dict, rank: int, groups: dict[int, Group], sites: dict[int, CallSite]) -> CollectiveEvent:
    """A ``c`` record as a ``CollectiveEvent``, every value type-checked; ``groups`` and ``sites`` are
    the file's definitions so far. Raises KeyError, TypeError or ValueError for a record that is not
    one. Keys this version does not know are ignored (a later writer may add optional ones)."""
    if not _C_REQUIRED <= rec.keys():
        raise KeyError(f"collective record without {sorted(_C_REQUIRED - rec.keys())}")
    values: dict[str, Any] = {"rank": rank, **_C_ABSENT}
    for key, value in rec.items():
        decoder = _C_DECODE.get(key)
        if decoder is not None:
            name, decode = decoder
            values[name] = decode(value)
    values["group"] = groups[values["group"]]
    if values["op"] not in CANONICAL_OPS:  # a writer that spelled it otherwise (a raw dispatcher name)
        values["op"] = canonical_op(values["op"]) or values["op"]
    site = values["call_site"]
    values["call_site"] = None if site is None else sites[site]
    splits = values.pop("splits", None)
    if splits is not None:
        values["in_splits"], values["out_splits"] = splits
    values.pop("counts", None)
    return CollectiveEvent(**values)


# ---- writing ----------------------------------------------------------------------------------------


def _writer(record: Record) -> Callable[..., str]:
    """A function writing ``record`` as one JSON line, from the JSON text of each value: required
    values as positional arguments, optional ones as keywords (None: left out). Generated from the
    table, so that the recorder's hot path is a single f-string."""
    required = [k for k in record.keys if k.required]
    optional = [k for k in record.keys if not k.required]
    constants: dict[str, str] = {}
    parts = [f'{{{{"k":"{record.kind}"']
    for k in record.keys:
        if k.required:
            parts.append(f',"{k.key}":{{{k.name}}}')
        else:
            constants[f"_{k.name}"] = f',"{k.key}":'
            parts.append(f'{{"" if {k.name} is None else _{k.name} + str({k.name})}}')
    params = ", ".join([k.name for k in required] + ["*"] * bool(optional) + [f"{k.name}=None" for k in optional])
    source = f"def encode_{record.kind}({params}):\n    return f'{''.join(parts)}}}}}\\n'\n"
    namespace: dict[str, Any] = dict(constants)
    exec(compile(source, f"<moedoctor.trace.schema: {record.kind} writer>", "exec"), namespace)  # noqa: S102
    function = namespace[f"encode_{record.kind}"]
    function.__doc__ = f"One ``{record.kind}`` record ({record.title}) from the JSON text of its values."
    function.source = source
    return function


#: ``encode_collective(event_id, group, seq, call_site, time, op, raw_op, in_shapes, out_shapes, dtypes,
#: async_op, thread, phase, step, *, p2p_seq=None, reduce_op=None, counts=None, splits=None, root=None,
#: module=None, peer=None) -> str``: every argument the JSON text of its value (an int may be given as
#: is); the line ends in ``\n``.
encode_collective = _writer(COLLECTIVE)


def fields(record: Record, /, *, after: str | None = None, **values: Any) -> dict[str, Any]:
    """One record of kind ``record`` as a dict in the table's key order, ready for ``format.encode``:
    ``"k"`` first (the header has none), then each key from the value given by its attribute name
    (``Key.name``); an optional key given None (or not given) is left out. With ``after``, only the
    keys after that one, for a writer that wrote the kind and the keys up to it itself (the C++
    kernel writes ``"k"`` and ``"id"`` of its ``g`` and ``s`` records). Raises TypeError for a name
    the table does not have or a required one missing: a writer out of step with the table fails
    its first test, not a reader."""
    names = {k.name for k in record.keys}
    unknown = values.keys() - names
    if unknown:
        raise TypeError(f"{record.kind or 'header'} record has no key named {sorted(unknown)}")
    keys = record.keys
    out: dict[str, Any] = {}
    if after is not None:
        keys = keys[[k.key for k in keys].index(after) + 1 :]
    elif record.kind:
        out["k"] = record.kind
    for k in keys:
        value = values.get(k.name)
        if value is not None:
            out[k.key] = value
        elif k.required:
            if k.name not in values:
                raise TypeError(f"{record.kind or 'header'} record without {k.name!r}")
            out[k.key] = None
    return out


def line_prefix(record: Record) -> bytes:
    """How every line of kind ``record`` begins (``{"k":"c"``), for scanners that sort lines by kind
    without parsing them."""
    return b'{"k":"' + record.kind.encode() + b'"'


def _json_value(key: Key, value) -> Any:
    if isinstance(value, Phase):
        return value.value
    if isinstance(value, tuple):
        return [_json_value(key, v) for v in value]
    return value


def record_of(event: CollectiveEvent, group_id: int, site_id: int | None) -> dict:
    """The ``c`` record of ``event`` as a dict in the table's key order (optional keys whose value is
    None left out), for writers outside the recorder: the test factory, converters."""
    rec: dict[str, Any] = {"k": COLLECTIVE.kind}
    for k in COLLECTIVE.keys:
        if k.name == "group":
            value: Any = group_id
        elif k.name == "call_site":
            value = site_id
        elif k.name == "splits":
            value = None if event.out_splits is None else [list(event.in_splits or ()), list(event.out_splits)]
        elif k.name == "counts":
            value = None
        else:
            value = _json_value(k, getattr(event, k.name))
        if value is not None or k.required:
            rec[k.key] = value
    return rec


# ---- checking any writer's output --------------------------------------------------------------


def problems(rec: dict) -> list[str]:
    """What is wrong with one parsed record line against the tables: an unknown kind, a missing or
    unknown key, a value of the wrong type, keys out of the table's order. Empty when none."""
    kind = rec.get("k")
    record = HEADER if "format" in rec else RECORDS.get(kind) if isinstance(kind, str) else None
    if record is None:
        return [f"unknown record kind {kind!r}"]
    keys = [k for k in rec if k != "k"]
    table = [k.key for k in record.keys]
    out = [f"{record.kind or 'header'}: unknown key {k!r}" for k in keys if k not in table]
    out += [f"{record.kind or 'header'}: missing key {k.key!r}" for k in record.keys if k.required and k.key not in rec]
    known = [k for k in keys if k in table]
    if known != sorted(known, key=table.index):
        out.append(f"{record.kind or 'header'}: keys {known} not in the table's order {table}")
    for k in record.keys:
        if k.key in rec:
            try:
                k.type.decode(rec[k.key])
            except (TypeError, ValueError, KeyError) as e:
                out.append(f"{record.kind or 'header'}: {k.key}={rec[k.key]!r:.80} is not a {k.type.name} ({e})")
    return out


# ---- scanning without parsing --------------------------------------------------------------------

#: What a value of each type looks like in a line both recorders write (no spaces; strings without
#: escapes where the scanners rely on them).
_VALUE = {
    INT: rb"-?\d+",
    COUNT: rb"\d+",
    NUMBER: rb"[^,]*",
    STR: rb'"[^"\\]*"',
    BOOL: rb"(?:true|false)",
    SHAPES: rb'\[[^"]*?\]',
    STRS: rb"\[[^\]]*\]",
    PHASE: rb'"[a-z_]*"',
    GROUP_REF: rb"\d+",
    SITE_REF: rb"(?:\d+|null)",
    OPT_INT: rb"(?:-?\d+|null)",
    INTS: rb"\[[^\]]*\]",
    SPLITS: rb"\[\[[^\]]*\],\[[^\]]*\]\]",
    RANKS: rb"\[[^\]]*\]",
}


def line_pattern(until: str, capture: tuple[str, ...], strings: tuple[str, ...] = ()) -> bytes:
    """A regular expression (bytes) matching the start of a ``c`` line up to and including key
    ``until`` (which must be there), with one group per key in ``capture`` in the table's order (a
    captured string without its quotes unless the key is in ``strings``, whose values may hold JSON
    escapes); optional keys before ``until`` are optional in the pattern too. Built from the table,
    so the scanners follow its order."""
    parts = [rb'\{"k":"c"']
    for k in COLLECTIVE.keys:
        value = _VALUE[k.type]
        if k.key in capture:
            if k.type is STR and k.key not in strings:
                value = rb'"([^"\\]*)"'
            elif k.type is STR:
                value = rb'("(?:[^"\\\n]|\\.)*")'
            else:
                value = b"(" + value + b")"
        elif k.type is STR and k.key in strings:
            value = rb'"(?:[^"\\\n]|\\.)*"'
        part = b',"' + k.key.encode() + b'":' + value
        parts.append(part if k.required or k.key == until else b"(?:" + part + b")?")
        if k.key == until:
            break
    else:
        raise KeyError(until)
    return b"".join(parts)


# ---- the C++ writer's header ---------------------------------------------------------------------

#: Each record kind's name in the C++ header: ``MDK_<NAME>_KIND``, ``MDK_<NAME>_<KEY>``.
CPP_NAMES = {
    "GROUP": GROUP,
    "SITE": SITE,
    "COLLECTIVE": COLLECTIVE,
    "DONE": DONE,
    "ANNOTATE": ANNOTATE,
    "EVIDENCE": EVIDENCE,
    "COVERAGE": COVERAGE,
    "CAP": CAP,
    "EXCEPTION": EXCEPTION,
}


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _key_text(key: Key) -> str:
    return ',"' + key.key + '":'


def cpp_macro(record: Record, key: str | None = None) -> str:
    """The name of the header's macro for ``record``'s kind (``key`` None) or for one of its keys: by
    the key's attribute name (``MDK_COLLECTIVE_EVENT_ID`` for ``i``), so that a key renamed on the wire
    is renamed in the C++ writer with nothing else to edit there."""
    name = next(n for n, r in CPP_NAMES.items() if r is record)
    return f"MDK_{name}_{'KIND' if key is None else record.key(key).name.upper()}"


def cpp_header() -> str:
    """The C++ writer's header (``moedoctor_schema.h``): per record kind, how its line begins
    (``MDK_COLLECTIVE_KIND``: ``{"k":"c"``) and each key as written after a value
    (``MDK_COLLECTIVE_P2P_SEQ``: ``,"pseq":``), as string literals the kernel joins with its own at
    compile time. Generated at each build of the native kernel (``recorder/native``), whose build
    name digests it: a key renamed on the wire is renamed there, and a key the kernel writes that
    the table lost is an undefined macro, a failed build (the Python kernels record instead)."""
    lines = [
        "// Generated by moedoctor.trace.schema.cpp_header() at each build of the native kernel: do not edit.",
        "#pragma once",
        f"#define MDK_FORMAT_VERSION {FORMAT_VERSION}",
    ]
    for record in CPP_NAMES.values():
        lines.append(f"// {record.kind}: {record.title}")
        lines.append(f"#define {cpp_macro(record)} {_c_string(line_prefix(record).decode())}")
        for k in record.keys:
            lines.append(f"#define {cpp_macro(record, k.key)} {_c_string(_key_text(k))}")
    return "\n".join(lines) + "\n"


# ---- documentation -------------------------------------------------------------------------------


def markdown(record: Record) -> str:
    """The table of ``record``'s keys for ``docs/trace-format.md``."""
    rows = ["| key | type | meaning |", "|---|---|---|"]
    for k in record.keys:
        rows.append(f"| `{k.key}` | {k.type.name}{'' if k.required else ', optional'} | {k.doc} |")
    return "\n".join(rows)


def sync_docs(text: str) -> str:
    """``text`` (``docs/trace-format.md``) with every ``<!-- schema:KIND -->`` ... ``<!-- /schema -->``
    section replaced by that kind's table (``header`` for the header)."""
    tables = {"header": HEADER, **RECORDS}

    def table(match: re.Match) -> str:
        return f"{match.group(1)}\n{markdown(tables[match.group(2)])}\n<!-- /schema -->"

    return re.sub(r"(<!-- schema:(\w+) -->)\n(?:(?!<!-- schema:).)*?<!-- /schema -->", table, text, flags=re.S)


if __name__ == "__main__":  # python -m moedoctor.trace.schema docs/trace-format.md: rewrite its tables
    import sys
    from pathlib import Path

    for name in sys.argv[1:]:
        doc = Path(name)
        doc.write_text(sync_docs(doc.read_text()))
