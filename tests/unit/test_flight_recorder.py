"""Flight Recorder dumps -> RankTrace: the committed Gloo dumps, NCCL-shaped dumps, what the dumps
cannot tell, folder detection, and mangled dumps (hypothesis) that must never raise past the reader."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moedoctor.events import Phase
from moedoctor.trace import format as fmt
from moedoctor.trace.flight_recorder import (
    FORMAT_NAME, is_flight_recorder_dir, normalize_op, read_flight_recorder,
)
from moedoctor.trace.reader import TraceError

DATA = Path(__file__).resolve().parent.parent / "data" / "flight_recorder"
PICKLES = DATA / "pickle"
JSONS = DATA / "json"

#: What tests/jobs/fr_dump.py issues on the default group "0", in order (Gloo names).
DEFAULT_GROUP_OPS = ["all_reduce", "broadcast", "all_gather", "all_reduce", "barrier"] + ["all_reduce"] * 6


def sample(rank: int) -> dict:
    with open(PICKLES / f"fr_rank_{rank}", "rb") as f:
        return pickle.load(f)  # our own committed file: plain pickle is fine here


def write_dump(folder: Path, name: str, dump: dict, encoding: str = "pickle") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(pickle.dumps(dump, protocol=2) if encoding == "pickle" else json.dumps(dump).encode())
    return path


def nccl_entry(record_id: int, seq: int, name: str, pg: tuple[str, str] = ("0", "default_pg"), pg_id: int = 0,
               sizes=((4,),), dtype: str = "Float", state: str = "completed", p2p_seq: int = 0,
               is_p2p: bool = False, frames=None) -> dict:
    return {
        "record_id": record_id, "pg_id": pg_id, "process_group": pg, "collective_seq_id": seq,
        "p2p_seq_id": p2p_seq, "op_id": record_id + 1, "profiling_name": name, "time_created_ns": 10**18 + record_id,
        "duration_ms": 1.0, "input_sizes": [list(s) for s in sizes], "input_dtypes": [dtype] * len(sizes),
        "output_sizes": [list(s) for s in sizes], "output_dtypes": [dtype] * len(sizes), "is_p2p": is_p2p,
        "state": state, "retired": state == "completed", "timeout_ms": 600000,
        "time_discovered_started_ns": 10**18 + record_id + 5 if state != "scheduled" else None,
        "time_discovered_completed_ns": 10**18 + record_id + 9 if state == "completed" else None,
        "frames": frames if frames is not None else [
            {"name": "all_reduce", "line": 3245,
             "filename": "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"},
            {"name": "train_step", "filename": "/job/train.py", "line": 40 + record_id},
            {"name": "main", "filename": "/job/train.py", "line": 90},
        ],
        "thread_id": "1", "thread_name": "pt_main_thread",
    }


def nccl_dump(rank: int, world: int = 4, entries=None) -> dict:
    return {
        "version": "2.10", "comm_lib_version": "2.27.5", "nccl_comm_state": {},
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(world)))},
                      "1": {"name": "1", "desc": "tp", "ranks": "[2, 3]"}},
        "pg_status": {"0": {"last_enqueued_collective": 2, "last_started_collective": 2,
                            "last_completed_collective": 1}},
        "entries": entries if entries is not None else [
            nccl_entry(0, 1, "nccl:all_reduce"),
            nccl_entry(1, 2, "nccl:_reduce_scatter_base", sizes=((8,),), dtype="BFloat16", state="started"),
        ],
    }


# --------------------------------------------------------------------------------- committed dumps

def test_pickle_dumps_round_trip_into_rank_traces():
    run = read_flight_recorder(PICKLES)
    assert [t.rank for t in run.traces] == [0, 1]
    assert run.source == "flight recorder (pickle, 2 ranks, world size not stated)"
    for trace in run.traces:
        h = trace.header
        assert (h.format, h.version, h.local_rank, h.world_size) == (FORMAT_NAME, 210, trace.rank, 2)
        assert trace.groups["0"].ranks == (0, 1) and trace.groups["0"].desc == "default_pg"
        assert trace.groups["1"].ranks == (0, 1)
        assert trace.problems == [] and trace.coverage == []
        default = [e for e in trace.events if e.group.name == "0"]
        assert [e.seq for e in default] == list(range(1, len(default) + 1))
        assert [e.op for e in default] == DEFAULT_GROUP_OPS[: len(default)]
        assert default[2].in_shapes == ((4,),) and default[2].out_shapes == ((2, 4),)  # all_gather
        assert default[4].in_shapes == ()  # barrier
        (pair,) = [e for e in trace.events if e.group.name == "1"]
        assert (pair.seq, pair.op, pair.raw_op, pair.in_shapes, pair.dtypes) == (
            1, "all_reduce", "gloo:all_reduce", ((2, 3),), ("float16",))
        assert all(e.phase is Phase.OTHER and e.step == 0 and e.reduce_op is None and not e.is_p2p
                   for e in trace.events)
        assert all(e.call_site is not None and e.call_site.file.endswith("tests/jobs/fr_dump.py")
                   for e in trace.events)
        assert {e.call_site.function for e in trace.events} == {"warm_up", "train_step"}
        assert default[-1].call_site.stack[0].endswith(" train_step")
        assert [e.dtypes for e in default[-2:]] in ([("float32",), ("float64",)], [("float64",), ("float32",)])
    rank0, rank1 = run.traces
    # rank 1 skipped the metric all_reduce of the last step: rank 0 waits alone in seq 11
    assert len([e for e in rank0.events if e.group.name == "0"]) == 11
    assert len([e for e in rank1.events if e.group.name == "0"]) == 10
    assert rank0.events[-1].completed is None and all(e.completed is not None for e in rank0.events[:-1])
    assert all(e.completed is not None for e in rank1.events)


def test_json_dumps_give_the_same_events_without_call_sites():
    from_pickle = read_flight_recorder(PICKLES)
    from_json = read_flight_recorder(JSONS)
    assert from_json.source.startswith("flight recorder (json, 2 ranks")
    for a, b in zip(from_pickle.traces, from_json.traces):
        assert [(e.group, e.seq, e.op, e.in_shapes, e.out_shapes, e.dtypes, e.completed is None) for e in a.events] == \
               [(e.group, e.seq, e.op, e.in_shapes, e.out_shapes, e.dtypes, e.completed is None) for e in b.events]
        assert all(e.call_site is None for e in b.events)
    assert any("JSON dumps carry no Python frames" in line for line in from_json.incomplete)
    assert not any("JSON" in line for line in from_pickle.incomplete)


def test_incomplete_states_what_gloo_dumps_cannot_tell():
    text = "\n".join(read_flight_recorder(PICKLES).incomplete)
    for needle in ("no phases, steps", "never leave 'scheduled'", "world size not stated",
                   "groups 0, 1", "no host or pid"):
        assert needle in text
    assert "ring buffer" not in text and "without a dump" not in text


def test_a_single_file_reads_as_one_rank():
    run = read_flight_recorder(PICKLES / "fr_rank_1")
    assert [t.rank for t in run.traces] == [1] and len(run.traces[0].events) == 11


def test_pickle_preferred_when_a_rank_has_both_dumps(tmp_path):
    shutil.copy(PICKLES / "fr_rank_0", tmp_path / "fr_rank_0")
    shutil.copy(JSONS / "fr_rank_0", tmp_path / "fr_rank_0.json")
    run = read_flight_recorder(tmp_path)
    assert len(run.traces) == 1 and run.traces[0].events[0].call_site is not None
    assert any("2 dumps" in line for line in run.incomplete)


# --------------------------------------------------------------------------------- NCCL-shaped dumps

def test_nccl_dump_groups_states_and_world_size_from_pg_config(tmp_path):
    write_dump(tmp_path, "nccl_trace_rank_0", nccl_dump(0))
    write_dump(tmp_path, "nccl_trace_rank_2", nccl_dump(2), encoding="json")
    run = read_flight_recorder(tmp_path)
    assert run.source == "flight recorder (json+pickle, 2 of 4 ranks)"
    assert any("ranks without a dump: 1, 3 (world size 4, stated by pg_config)" in line for line in run.incomplete)
    trace = run.traces[0]
    assert trace.header.world_size == 4 and trace.groups["0"].ranks == (0, 1, 2, 3)
    first, second = trace.events
    assert (first.op, first.completed) == ("all_reduce", (10**18 + 9) / 1e9)
    assert (second.op, second.raw_op, second.dtypes, second.completed) == (
        "reduce_scatter", "nccl:_reduce_scatter_base", ("bfloat16",), None)
    assert first.call_site.short == "train.py:40" and first.call_site.stack == ("/job/train.py:40 train_step",
                                                                                 "/job/train.py:90 main")


def test_nccl_p2p_peer_is_a_global_rank_and_p2p_seq_is_kept(tmp_path):
    tp = ("1", "tp")
    entries = [nccl_entry(0, 0, "nccl:send 0->1", pg=tp, pg_id=1, is_p2p=True, p2p_seq=1),
               nccl_entry(1, 0, "nccl:recv 0<-1", pg=tp, pg_id=1, is_p2p=True, p2p_seq=2)]
    write_dump(tmp_path, "fr_2", nccl_dump(2, entries=entries))
    send, recv = read_flight_recorder(tmp_path).traces[0].events
    assert (send.op, send.peer, send.p2p_seq, send.seq, send.is_p2p) == ("send", 3, 1, 0, True)
    assert (recv.op, recv.peer, recv.p2p_seq) == ("recv", 3, 2)
    assert send.group.ranks == (2, 3) and send.group.desc == "tp"


def test_wrapped_ring_buffer_is_reported(tmp_path):
    dump = sample(0)
    dump["entries"] = dump["entries"][3:]
    write_dump(tmp_path, "fr_rank_0", dump)
    shutil.copy(PICKLES / "fr_rank_1", tmp_path / "fr_rank_1")
    run = read_flight_recorder(tmp_path)
    assert any("rank 0: ring buffer wrapped, 3 older entries dropped (earliest kept: group 0 seq 4" in line
               for line in run.incomplete)
    assert run.traces[0].events[0].seq == 4


@pytest.mark.parametrize("name, op, peer", [
    ("nccl:all_reduce", "all_reduce", None), ("gloo:broadcast", "broadcast", None),
    ("nccl:_reduce_scatter_base", "reduce_scatter", None), ("nccl:_allgather_base", "all_gather", None),
    ("nccl:send 0->1", "send", 1), ("nccl:recv 3<-0", "recv", 0), ("gloo:all_to_all", "all_to_all", None),
    ("nccl:allgather_into_tensor_coalesced", "all_gather_coalesced", None),
    ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter_coalesced", None), ("gloo:barrier", "barrier", None),
    ("nccl:coalesced", "coalesced", None), ("nccl:ALLGATHER_coalesced", "all_gather_coalesced", None),
    ("nccl:all_to_all_v_single", "all_to_all", None), ("nccl:all_reduce_barrier", "barrier", None),
])
def test_profiling_names_are_normalized(name, op, peer):
    assert normalize_op(name) == (op, peer)


# --------------------------------------------------------------------------------- refusing and detecting

class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_alone_and_skipped_in_a_folder(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "dumps"
    shutil.copytree(PICKLES, folder)
    dump = sample(1)
    dump["entries"].append(_Exploit(marker))
    evil = write_dump(folder, "fr_rank_1", dump)
    with pytest.raises(TraceError, match="refused"):
        read_flight_recorder(evil)
    run = read_flight_recorder(folder)
    assert [t.rank for t in run.traces] == [0]
    assert any(line.startswith("rank 1: dump unreadable") and "nothing was executed" in line for line in run.incomplete)
    assert any("ranks without a dump: 1" in line for line in run.incomplete)
    assert not marker.exists()


def moedoctor_run_dir(root: Path) -> Path:
    traces = root / "traces"
    traces.mkdir(parents=True)
    head = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "rank": 0, "local_rank": 0, "world_size": 1,
            "host": "h", "pid": 1, "torch": "2.13", "moedoctor": "0.1.0", "start_time": 1.0}
    (traces / fmt.trace_file_name(0)).write_bytes(fmt.encode(head))
    (root / "manifest.json").write_text(json.dumps({"entries": [], "version": 1}))
    return root


def test_detection_by_content(tmp_path):
    assert is_flight_recorder_dir(PICKLES) and is_flight_recorder_dir(JSONS)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(JSONS / "fr_rank_0", renamed / "whatever.txt")
    assert is_flight_recorder_dir(renamed)
    run_dir = moedoctor_run_dir(tmp_path / "run")
    assert not is_flight_recorder_dir(run_dir) and not is_flight_recorder_dir(run_dir / "traces")
    (tmp_path / "empty").mkdir()
    assert not is_flight_recorder_dir(tmp_path / "empty")
    assert not is_flight_recorder_dir(tmp_path / "absent")
    assert not is_flight_recorder_dir(PICKLES / "fr_rank_0")  # a file, not a folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes_1").write_text("entries and version, in prose")
    (other / "data_0").write_bytes(pickle.dumps([1, 2, 3]))
    assert not is_flight_recorder_dir(other)


def test_folders_without_dumps_are_trace_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no PyTorch Flight Recorder dumps"):
        read_flight_recorder(tmp_path / "empty")
    with pytest.raises(TraceError, match="no such file"):
        read_flight_recorder(tmp_path / "absent")
    with pytest.raises(TraceError):
        read_flight_recorder(moedoctor_run_dir(tmp_path / "run") / "traces" / fmt.trace_file_name(0))


def test_truncated_rank_named_like_the_others_is_reported(tmp_path):
    shutil.copy(PICKLES / "fr_rank_0", tmp_path / "fr_rank_0")
    (tmp_path / "fr_rank_1").write_bytes((PICKLES / "fr_rank_1").read_bytes()[:3])
    run = read_flight_recorder(tmp_path)
    assert [t.rank for t in run.traces] == [0]
    assert any(line.startswith("rank 1: dump unreadable") for line in run.incomplete)


# --------------------------------------------------------------------------------- mangled dumps

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)
ENTRY_KEYS = sorted(sample(0)["entries"][0])
TOP_KEYS = sorted(sample(0))


@st.composite
def mangled_dump(draw) -> dict:
    """A real dump with fields deleted or replaced by values of the wrong type."""
    dump = copy.deepcopy(sample(draw(st.sampled_from([0, 1]))))
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()) and dump.get("entries") and isinstance(dump["entries"], list):
            target = dump["entries"][draw(st.integers(0, len(dump["entries"]) - 1))]
            if not isinstance(target, dict):
                continue
            key = draw(st.sampled_from(ENTRY_KEYS))
        else:
            target, key = dump, draw(st.sampled_from(TOP_KEYS))
        if draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = draw(JUNK)
    return dump


@st.composite
def mangled_bytes(draw) -> bytes:
    folder, rank = draw(st.sampled_from([PICKLES, JSONS])), draw(st.sampled_from([0, 1]))
    data = bytearray((folder / f"fr_rank_{rank}").read_bytes())
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    for _ in range(draw(st.integers(0, 6))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_single_file_reads_or_refuses(path: Path) -> None:
    try:
        run = read_flight_recorder(path)
    except TraceError:
        return
    assert len(run.traces) == 1


@SETTINGS
@given(data=mangled_bytes())
def test_mangled_bytes_only_ever_raise_trace_error(tmp_path, data):
    path = tmp_path / "fr_rank_0"
    path.write_bytes(data)
    assert_single_file_reads_or_refuses(path)


@SETTINGS
@given(dump=mangled_dump(), encoding=st.sampled_from(["pickle", "json"]))
def test_mangled_fields_only_ever_raise_trace_error(tmp_path, dump, encoding):
    try:
        path = write_dump(tmp_path, "fr_rank_0", dump, encoding)
    except ValueError:  # JSON cannot hold a NaN key etc.: nothing to test
        return
    assert_single_file_reads_or_refuses(path)


@SETTINGS
@given(data=mangled_bytes(), dump=mangled_dump())
def test_a_folder_with_damaged_dumps_reads_partially(tmp_path, data, dump):
    folder = tmp_path / "dumps"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    shutil.copy(PICKLES / "fr_rank_0", folder / "fr_rank_0")
    (folder / "fr_rank_1").write_bytes(data)
    write_dump(folder, "fr_rank_2", dump)
    run = read_flight_recorder(folder)
    ranks = [t.rank for t in run.traces]
    assert ranks[0] == 0 and ranks == sorted(ranks) and set(ranks) <= {0, 1, 2}
    assert len(run.traces[0].events) == 12 and run.traces[0].problems == []
    for missing in {1, 2} - set(ranks):
        assert any(line.startswith(f"rank {missing}: dump unreadable") for line in run.incomplete)
    assert run.source.startswith("flight recorder (")


def test_dumps_without_entries_are_refused_not_called_healthy(tmp_path):
    import pickle

    from moedoctor.analysis import load_run
    from moedoctor.errors import MoedoctorError

    for rank in (0, 1):
        (tmp_path / f"fr_rank_{rank}").write_bytes(pickle.dumps(
            {"version": "2.10", "entries": [], "pg_config": {}, "pg_status": {}, "comm_lib_version": "2.21"}))
    import pytest

    with pytest.raises(MoedoctorError, match="hold no entries"):
        load_run(tmp_path)
