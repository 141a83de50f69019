"""Hypothesis strategies for hostile input to ``moedoctor analyze`` (issue 12's fuzz suite,
tests/unit/test_fuzz_analyze.py). Each strategy draws a whole input folder as ``{relative path:
bytes}`` (``None`` for a directory where a file is expected), made from real input damaged the
ways faulty runs and hostile files damage it:

- ``trace_inputs``: a golden run directory (tests/golden: traces, manifest, stacks, GPU
  snapshots), or its traces alone, with records and headers given values of the wrong type or
  size (huge ints, NaN, deep or long lists, long strings, numbers of 5,000 digits), lines
  inserted, cut, duplicated or over the record cap, bytes flipped, files dropped, copied under
  other rank numbers or replaced by a folder, and status, manifest, stack, GPU and marker files
  added or damaged;
- ``flight_recorder_inputs``: the committed Flight Recorder dumps (tests/data/flight_recorder),
  pickle (protocols 0-5) or JSON, with fields given hostile values (self-references, a shared
  DAG of 2^40 paths, nesting past the caps, huge ints, bytes), entries multiplied or dropped,
  files renamed, truncated or flipped, and pickles that ask to import or call something.

Every value is bounded so that drawing and writing an input stays cheap (a few MB at most).
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

from hypothesis import strategies as st

from moedoctor.trace import format as fmt

TESTS = Path(__file__).resolve().parent
GOLDEN = TESTS / "golden"
FR = TESTS / "data" / "flight_recorder"
GOLDEN_RUNS = sorted(p.name for p in GOLDEN.iterdir() if (p / "traces").is_dir())

# ---- values ---------------------------------------------------------------------------------------


class Raw:
    """JSON text put in place as it is: what ``json.dumps`` cannot write (deep nesting, a number of
    5,000 digits) or would write slowly."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''} {len(self.text)} chars)"


def _raw(kind: str, n: int) -> Raw:
    if kind == "deep":
        return Raw("[" * n + "]" * n)
    if kind == "deep_dict":
        return Raw('{"a":' * n + "1" + "}" * n)
    if kind == "long":
        return Raw("[" + ",".join(["7"] * n) + "]")
    if kind == "shapes":
        return Raw("[" + ",".join(["[1,2]"] * n) + "]")
    if kind == "string":
        return Raw(json.dumps("x" * n))
    return Raw("9" * n)  # "digits": a number Python refuses to parse past 4,300 digits


SIZES = st.sampled_from([0, 1, 2, 65, 1000, 5000, 100_000])
RAW = st.builds(_raw, st.sampled_from(["deep", "deep_dict", "long", "shapes", "string", "digits"]), SIZES)
SPECIAL = st.sampled_from([
    None, True, False, 0, -1, 1, 2, 63, 64, 4096, 4097, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**12,
    -(2**63), 10**30, 2**1000, float("nan"), float("inf"), float("-inf"), -0.0, 1e-300, "", "x" * 5000,
    "\x00", "é" * 50, "NaN", [], {}, [[]], [None], [[1, 2], [3]], [-1], [2**64], {"k": "c"},
]).map(copy.deepcopy)  # a container drawn twice must be two containers: inputs are mutated in place
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=8,
)
#: A value for a JSON field: plain junk, a special value, or raw JSON text of hostile size or depth.
HOSTILE_JSON = st.one_of(JUNK, SPECIAL, RAW)


def dumps(value) -> bytes:
    """JSON with ``Raw`` parts put in place."""
    raws: list[str] = []

    def mark(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {str(k): mark(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(value), separators=(",", ":"))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw, 1)
    return text.encode()


MAX_PARSED_DEPTH = 200


def _loads(data: bytes):
    """JSON parsed for further damage, or None: not JSON, or nested deeper than ``MAX_PARSED_DEPTH``
    (an earlier draw's): whether Python could parse and re-encode it would depend on the stack's
    depth, and drawing must not."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    if deepest > MAX_PARSED_DEPTH:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _set_at_path(draw, doc, value_strategy, delete_ok: bool = True):
    """Walk a random path into ``doc`` (dicts and lists) and replace or delete what is there;
    returns the (possibly new) document."""
    if not isinstance(doc, (dict, list)) or not doc or draw(st.integers(0, 5)) == 0:
        return draw(value_strategy)
    node = doc
    for _ in range(draw(st.integers(0, 4))):
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        nested = [(k, v) for k, v in children if isinstance(v, (dict, list)) and v]
        if not nested:
            break
        node = draw(st.sampled_from(nested))[1]
    if isinstance(node, dict):
        key = draw(st.sampled_from(sorted(node, key=str)) | st.text(max_size=6)) if node else draw(st.text(max_size=6))
        if delete_ok and key in node and draw(st.booleans()):
            del node[key]
        else:
            node[key] = draw(value_strategy)
    elif node:
        index = draw(st.integers(0, len(node) - 1))
        if delete_ok and draw(st.booleans()):
            del node[index]
        else:
            node[index] = draw(value_strategy)
    return doc


def _damage_bytes(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "cut_line"]))
    if kind == "truncate" or not data:
        return data[: draw(st.integers(0, len(data)))]
    pos = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        return data[:pos] + draw(st.binary(min_size=1, max_size=8)) + data[pos + 1:]
    if kind == "insert":
        return data[:pos] + draw(st.binary(max_size=64)) + data[pos:]
    end = data.find(b"\n", pos)
    return data[:pos] + (data[end:] if end >= 0 else b"")  # half a line gone


# ---- moedoctor traces and run directories -------------------------------------------------------

RECORD_KEYS = ["k", "i", "g", "s", "seq", "pseq", "peer", "t", "op", "raw", "in", "out", "dt", "red", "async",
               "th", "ph", "step", "mod", "root", "sp", "n", "id", "name", "desc", "ranks", "file", "line", "fn",
               "stack", "kind", "data", "reason", "groups", "dropped", "limit", "src"]
HEADER_KEYS = ["format", "version", "rank", "local_rank", "world_size", "host", "pid", "torch", "moedoctor",
               "start_time"]
KINDS = ["c", "d", "a", "e", "v", "g", "s", "cap", "zz"]


def _golden_files(name: str) -> dict[str, bytes]:
    root = GOLDEN / name
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "expected_report.json"}


_GOLDEN_FILES = {name: _golden_files(name) for name in GOLDEN_RUNS}


def _trace_names(files: dict) -> list[str]:
    return sorted(k for k, v in files.items() if k.endswith(".jsonl") and v is not None)


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def _mutate_line(draw, data: bytes, header: bool) -> bytes:
    lines = _lines(data)
    if len(lines) < 2 and not header:
        return data
    index = 0 if header else draw(st.integers(1, max(1, len(lines) - 2)))
    record = _loads(lines[index])
    if not isinstance(record, dict):
        return data
    keys = st.sampled_from(HEADER_KEYS if header else RECORD_KEYS)
    key = draw(keys | st.sampled_from(sorted(record)) if record else keys)
    if draw(st.integers(0, 4)) == 0:
        record.pop(key, None)
    else:
        record[key] = draw(HOSTILE_JSON)
    lines[index] = dumps(record)
    return b"\n".join(lines)


def _hostile_line(draw) -> bytes:
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return dumps(draw(HOSTILE_JSON))
    if choice == 1:
        return b"x" * draw(st.sampled_from([10, (1 << 20) + 10]))  # over the record cap: 1 MiB
    record = {"k": draw(st.sampled_from(KINDS))}
    for key in draw(st.lists(st.sampled_from(RECORD_KEYS), max_size=6)):
        record[key] = draw(HOSTILE_JSON)
    return dumps(record)


@st.composite
def trace_inputs(draw) -> dict[str, bytes | None]:
    """A run directory (or a folder of traces) from tests/golden, damaged."""
    files: dict[str, bytes | None] = dict(_GOLDEN_FILES[draw(st.sampled_from(GOLDEN_RUNS))])
    if not draw(st.booleans()):  # a folder of traces alone
        files = {k.removeprefix("traces/"): v for k, v in files.items() if k.startswith("traces/")}
    prefix = "traces/" if "manifest.json" in files else ""
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["record", "record", "header", "line", "bytes", "drop", "copy", "dir",
                                   "status", "manifest", "stack", "gpu", "marker", "interrupted", "ragged"]))
        traces = _trace_names(files)
        if op in ("record", "header", "line", "bytes", "drop", "copy", "ragged") and not traces:
            continue
        target = draw(st.sampled_from(traces)) if traces else None
        if op in ("record", "header"):
            files[target] = _mutate_line(draw, files[target], header=op == "header")
        elif op == "line":
            lines = _lines(files[target])
            lines.insert(draw(st.integers(0, len(lines))), _hostile_line(draw))
            files[target] = b"\n".join(lines)
        elif op == "bytes":
            files[target] = _damage_bytes(draw, files[target])
        elif op == "drop":
            del files[target]
        elif op == "copy":
            rank = draw(st.sampled_from([0, 1, 2, 7, 99999, 10**6, 10**9]))
            files[f"{prefix}{fmt.trace_file_name(rank)}"] = files[target]
        elif op == "dir":
            files[f"{prefix}{fmt.trace_file_name(draw(st.integers(0, 3)))}"] = None
        elif op == "status":
            rank = draw(st.sampled_from([0, 1, 2, 10**6]))
            state = draw(st.sampled_from([fmt.RECORDING, fmt.STOPPED]))
            data = fmt.encode_status(rank, 1, state, t=1.0, errno=28, error="No space left on device",
                                     file="rank-00000.jsonl", events=3)
            if draw(st.booleans()):
                data = dumps(_set_at_path(draw, _loads(data), HOSTILE_JSON))
            files[f"{prefix}{fmt.status_file_name(rank % 100)}"] = data
        elif op == "manifest":
            current = files.get("manifest.json")
            doc = _loads(current) if current else {}
            files["manifest.json"] = (dumps(_set_at_path(draw, doc, HOSTILE_JSON)) if draw(st.integers(0, 4))
                                      else _damage_bytes(draw, current or b"{}"))
        elif op == "stack":
            stacks = sorted(k for k in files if k.startswith("stacks/") and files[k] is not None)
            name = draw(st.sampled_from(stacks)) if stacks else f"stacks/rank-{draw(st.integers(0, 2))}.json"
            files[name] = dumps(_set_at_path(draw, _loads(files.get(name) or b"{}"), HOSTILE_JSON))
        elif op == "gpu":
            files[f"gpu/{draw(st.sampled_from(['host', 'node-1']))}.json"] = dumps(draw(HOSTILE_JSON))
        elif op == "marker":
            files[f"control/recorder-rank-{draw(st.sampled_from([0, 1, 5, 10**7]))}"] = draw(st.binary(max_size=20))
        elif op == "interrupted":
            # The run ended without its supervisor saying how: Ctrl-C (``interrupted``), or kill -9
            # (``running``, no one holding the lock); a node entry that lost its pid or host.
            current = files.get("manifest.json")
            doc = _loads(current) if current else {}
            if isinstance(doc, dict):
                doc["status"] = draw(st.sampled_from(["running", "interrupted"]))
                doc["hang"] = None
                for node in (doc.get("nodes") or {}).values() if isinstance(doc.get("nodes"), dict) else ():
                    if isinstance(node, dict):
                        node["status"], node["end"] = doc["status"], draw(st.sampled_from([None, 1.0, "x", 10**30]))
                        if draw(st.booleans()):
                            node[draw(st.sampled_from(["moedoctor_pid", "host"]))] = draw(HOSTILE_JSON)
                files["manifest.json"] = dumps(doc)
            files["supervisor-node0.lock"] = b"999999 gone\n"  # nobody holds it: a killed supervisor
        elif op == "ragged":
            # A trace cut a few collectives short, as a rank stopped mid-step leaves it.
            lines = _lines(files[target])
            files[target] = b"\n".join(lines[: max(1, len(lines) - draw(st.integers(1, 5)))]) + b"\n"
    return files


# ---- Flight Recorder dumps ----------------------------------------------------------------------


def _sample(kind: str, rank: int) -> dict:
    data = (FR / kind / f"fr_rank_{rank}").read_bytes()
    return pickle.loads(data) if kind == "pickle" else json.loads(data)  # our own committed files


_SAMPLES = {(kind, rank): _sample(kind, rank) for kind in ("pickle", "json") for rank in (0, 1)}


class _SelfRef:
    """Stands for the container it is put in (pickle only)."""


def _dag(depth: int) -> list:
    node: list = []
    for _ in range(depth):
        node = [node, node]  # 2^depth paths, depth + 1 objects
    return node


def _deep(depth: int) -> list:
    node: list = []
    for _ in range(depth):
        node = [node]
    return node


PY_HOSTILE = st.one_of(
    JUNK, SPECIAL,
    st.binary(max_size=16),
    st.tuples(st.integers(-2, 2**64), st.text(max_size=3)),
    st.just(_SelfRef()),
    st.builds(_dag, st.sampled_from([3, 12, 40])),
    st.builds(_deep, st.sampled_from([5, 33, 200])),
    st.builds(lambda n: [[1, 2]] * n, st.sampled_from([10, 5000, 1 << 16])),
    st.builds(lambda n: "y" * n, st.sampled_from([100, (1 << 20) + 1])),
)
#: Pickles that ask for something other than plain data (nothing may run).
MALICIOUS = [
    b"cos\nsystem\n(S'touch /tmp/moedoctor-fuzz-pwned'\ntR.",
    b"\x80\x02cbuiltins\neval\nq\x00X\x05\x00\x00\x001+1+1q\x01\x85q\x02Rq\x03.",
    b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06getcwd\x94\x93\x94)R\x94.",
    b"(i__builtin__\nobject\n.",
    b"\x80\x02}q\x00X\x07\x00\x00\x00entriesq\x01]q\x02sb.",
    b"\x80\x02]q\x00(K\x01h\x00e.",  # a list holding itself
    b"\x80\x02]q\xffK\x01a.",  # a memo index far beyond the slots used
]
NAMES = ["fr_rank_{r}", "nccl_trace_rank_{r}", "rank{r}.json", "dump_{r}.pkl", "fr_rank_x", "fr_rank_{r}_{r}"]


def _resolve_self(value, container):
    if isinstance(value, _SelfRef):
        return container
    return value


def _mutate_dump(draw, dump: dict, kind: str) -> dict:
    """Replace or delete a field somewhere in the dump (for JSON: values JSON can hold)."""
    strategy = PY_HOSTILE if kind == "pickle" else HOSTILE_JSON
    if not isinstance(dump, (dict, list)) or not draw(st.integers(0, 5)):
        return draw(strategy)
    node = dump
    for _ in range(draw(st.integers(0, 3))):
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        nested = [v for _, v in children if isinstance(v, (dict, list)) and v]
        if not nested:
            break
        node = draw(st.sampled_from(nested))
    if isinstance(node, dict):
        key = draw(st.sampled_from(sorted(node, key=str)) | st.text(max_size=6)) if node else "entries"
        if draw(st.integers(0, 3)) == 0:
            node.pop(key, None)
        else:
            node[key] = _resolve_self(draw(strategy), node)
    elif node:
        node[draw(st.integers(0, len(node) - 1))] = _resolve_self(draw(strategy), node)
    return dump


def _encode(draw, dump, kind: str) -> bytes:
    if kind == "json":
        return dumps(dump)
    try:
        return pickle.dumps(dump, protocol=draw(st.integers(0, 5)))
    except (RecursionError, ValueError, TypeError):
        return pickle.dumps({"entries": "unpicklable"}, protocol=2)


@st.composite
def flight_recorder_inputs(draw) -> dict[str, bytes | None]:
    """A folder of Flight Recorder dumps (or a folder with one), damaged."""
    kind = draw(st.sampled_from(["pickle", "json"]))
    dumps_by_name = {f"fr_rank_{r}": copy.deepcopy(_SAMPLES[(kind, r)]) for r in (0, 1)}
    raw: dict[str, bytes | None] = {}
    for _ in range(draw(st.integers(1, 5))):
        op = draw(st.sampled_from(["field", "field", "field", "entries", "rename", "extra", "bytes", "malicious",
                                   "drop", "oversized"]))
        names = sorted(dumps_by_name)
        if not names:
            break
        name = draw(st.sampled_from(names))
        if op == "field":
            dumps_by_name[name] = _mutate_dump(draw, dumps_by_name[name], kind)
        elif op == "entries" and isinstance(dumps_by_name[name], dict) \
                and isinstance(dumps_by_name[name].get("entries"), list):
            entries = dumps_by_name[name]["entries"]
            dumps_by_name[name]["entries"] = draw(st.sampled_from([
                [], entries[:1], entries * 50, list(reversed(entries)), entries[::2]]))
        elif op == "rename":
            rank = draw(st.sampled_from([0, 1, 2, 3, 10**6, 10**13]))
            dumps_by_name[draw(st.sampled_from(NAMES)).format(r=rank)] = dumps_by_name.pop(name)
        elif op == "extra":
            dumps_by_name[f"fr_rank_{draw(st.integers(2, 4))}"] = copy.deepcopy(dumps_by_name[name])
        elif op == "bytes":
            raw[name] = _damage_bytes(draw, _encode(draw, dumps_by_name.pop(name), kind))
        elif op == "malicious":
            dumps_by_name.pop(name)
            raw[name] = draw(st.sampled_from(MALICIOUS))
        elif op == "drop":
            dumps_by_name.pop(name)
        elif op == "oversized":
            # A JSON dump whose one shape has millions of dimensions (a few MB of "1,"): refused while
            # it is read, before the parser builds it (tests/cli/test_analyze_bounds.py measures 200 MB).
            dumps_by_name.pop(name)
            raw[name] = oversized_json_dump(draw(st.sampled_from([6_000_000, 8_000_000])))
    for name, dump in dumps_by_name.items():
        raw[name] = _encode(draw, dump, kind)
    return raw


def oversized_json_dump(items: int) -> bytes:
    """A Flight Recorder JSON dump, one entry, whose input shape has ``items`` dimensions (2 bytes each)."""
    head = (b'{"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}, '
            b'"pg_status": {}, "entries": [{"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], '
            b'"collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1, "profiling_name": "gloo:all_reduce", '
            b'"time_created_ns": 1, "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"], '
            b'"state": "completed", "input_sizes": [[')
    return head + b"1," * (items - 1) + b"1]]}]}"


def write_input(folder: Path, files: dict[str, bytes | None]) -> Path:
    """Lay the drawn files out under ``folder`` (``None``: a folder where a file is expected)."""
    folder.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            path.mkdir(exist_ok=True)
        else:
            path.write_bytes(data)
    return folder
