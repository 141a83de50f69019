"""Completion from PyTorch's Flight Recorder, fused into moedoctor's traces by (group, sequence number).

At analysis time: run directories built in-test (traces whose collectives have no completion, as on
NCCL, plus ``flight_recorder/fr_rank_N`` dumps shaped like NCCL's), checking completed / pending /
unknown, the ring buffer's truncation, disagreeing numbering, p2p batches, the wait-for graph and
the completion measure. At run time: ``LiveTracker`` following a trace and reading active-only dumps.
"""

from __future__ import annotations

import json
import types

from event_factory import TraceBuilder, write_traces
from test_flight_recorder import nccl_entry, write_dump

from moedoctor.analysis import analyze, load_run
from moedoctor.analysis.loading.completion import completion_stats
from moedoctor.analysis.evidence.view import RunView
from moedoctor.analysis.mechanisms.waitfor import blocked_event
from moedoctor.events import Group
from moedoctor.render.json_report import report_to_dict
from moedoctor.trace.fr_completion import (
    FrEntry, LiveTracker, compatible, entries_from_dump, fuse,
)

WORLD = Group("0", "default_pg", (0, 1))
TP = Group("1", "tp", (0, 1))


def dump_of(entries, world: int = 2) -> dict:
    return {"version": "2.10", "comm_lib_version": "2.28.9", "nccl_comm_state": {},
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(list(range(world)))},
                          "1": {"name": "1", "desc": "tp", "ranks": json.dumps(list(range(world)))}},
            "pg_status": {}, "entries": entries}


def entries(*specs, first_record: int = 0) -> list[dict]:
    """(seq, profiling name, state[, group]) -> NCCL entries with consecutive record ids."""
    out = []
    for i, spec in enumerate(specs):
        seq, name, state = spec[:3]
        pg = (TP.name, TP.desc) if len(spec) > 3 and spec[3] == "tp" else (WORLD.name, WORLD.desc)
        out.append(nccl_entry(first_record + i, seq, name, pg=pg, pg_id=int(pg[0]), state=state))
    return out


def run_dir(tmp_path, builders, dumps: dict[int, dict]):
    write_traces(tmp_path / "traces", *builders)
    for rank, dump in dumps.items():
        write_dump(tmp_path / "flight_recorder", f"fr_rank_{rank}", dump)
    return load_run(tmp_path)


def states(run, rank: int) -> list[tuple]:
    trace = run.trace_of[rank]
    view = RunView(run)
    return [(e.group.name, e.seq, "done" if e.completed is not None else
             "pending" if e.event_id in trace.fr_pending else
             "unknown" if e.event_id in trace.fr_unknown else "none", view.completion_source(rank, e))
            for e in trace.events]


# ------------------------------------------------------------------------------ analysis-time fusion

def test_states_are_fused_by_group_and_sequence_number(tmp_path):
    b = TraceBuilder(0, 2)
    for _ in range(5):
        b.coll("all_reduce", (4,), done=False)
    b.coll("all_reduce", (4,), group=TP, done=False)
    b.coll("all_reduce", (4,), group=TP, done=False)
    fr = entries((1, "nccl:all_reduce", "completed"), (2, "nccl:all_reduce", "completed"),
                 (1, "nccl:all_reduce", "completed", "tp"), (3, "nccl:all_reduce", "completed"),
                 (4, "nccl:all_reduce", "completed"), (2, "nccl:all_reduce", "scheduled", "tp"),
                 (5, "nccl:all_reduce", "started"))
    run = run_dir(tmp_path, [b], {0: dump_of(fr)})
    assert states(run, 0) == [("0", s, "done", "flight-recorder-dump") for s in range(1, 5)] + [
        ("0", 5, "pending", None), ("1", 1, "done", "flight-recorder-dump"), ("1", 2, "pending", None)]
    stats = completion_stats(run.traces)
    assert (stats.observed, stats.provable, stats.pending, stats.unknown) == (5, 5, 2, 0)
    assert stats.sentence() == "completion observed for 5 of 5 collectives (source: flight-recorder-dump 5)"
    doc = report_to_dict(analyze(run))
    assert doc["completion"]["by_source"] == {"flight-recorder-dump": 5} and doc["completion"]["pending"] == 2


def test_entries_older_than_the_ring_buffer_are_unknown_not_pending(tmp_path):
    b = TraceBuilder(0, 2)
    for _ in range(5):
        b.coll("all_reduce", (4,), done=False)
    wrapped = entries((4, "nccl:all_reduce", "scheduled"), (5, "nccl:all_reduce", "scheduled"), first_record=3)
    run = run_dir(tmp_path, [b], {0: dump_of(wrapped)})
    assert [s[2] for s in states(run, 0)] == ["unknown"] * 3 + ["pending"] * 2
    stats = completion_stats(run.traces)
    assert (stats.observed, stats.provable, stats.pending, stats.unknown) == (0, 0, 2, 3)


def test_a_completed_entry_proves_the_older_ones_beyond_the_ring_buffer(tmp_path):
    b = TraceBuilder(0, 2)
    for _ in range(5):
        b.coll("all_reduce", (4,), done=False)
    wrapped = entries((4, "nccl:all_reduce", "completed"), (5, "nccl:all_reduce", "scheduled"), first_record=3)
    run = run_dir(tmp_path, [b], {0: dump_of(wrapped)})
    assert [s[2:] for s in states(run, 0)] == [("done", "flight-recorder-dump")] * 4 + [("pending", None)]


def test_the_traces_own_completions_are_kept_and_used(tmp_path):
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,), done=False).coll("all_reduce", (4,), done=True).coll("all_reduce", (4,), done=False)
    fr = entries((1, "nccl:all_reduce", "scheduled"), (2, "nccl:all_reduce", "completed"),
                 (3, "nccl:all_reduce", "scheduled"))
    run = run_dir(tmp_path, [b], {0: dump_of(fr)})
    # seq 1: Flight Recorder shows it pending, but the Work of seq 2 completed: group order wins
    assert [s[2:] for s in states(run, 0)] == [("done", "flight-recorder-dump"), ("done", "work"), ("pending", None)]


def test_disagreeing_numbering_is_not_fused_from_there_on(tmp_path):
    b = TraceBuilder(0, 2)
    for op in ("all_reduce", "all_reduce", "all_reduce", "all_reduce"):
        b.coll(op, (4,), done=False)
    fr = entries((1, "nccl:all_reduce", "completed"), (2, "nccl:broadcast", "completed"),
                 (3, "nccl:all_reduce", "completed"), (4, "nccl:all_reduce", "completed"))
    run = run_dir(tmp_path, [b], {0: dump_of(fr)})
    assert [s[2] for s in states(run, 0)] == ["done", "unknown", "unknown", "unknown"]
    assert any("rank 0, group 0: Flight Recorder's collective #2 is not the trace's" in n for n in run.incomplete)


def test_a_gap_in_the_buffer_stops_the_fusion():
    """Gloo: all_reduce, monitored_barrier, all_reduce is #1 and #4 in Flight Recorder (the
    barrier is not recorded and takes two numbers), #1, #2, #3 in the trace."""
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,), done=False).coll("monitored_barrier", (), done=False).coll("all_reduce", (4,), done=False)
    fr = [FrEntry("0", 1, False, "all_reduce", 0, 1.0, numel=4), FrEntry("0", 4, False, "all_reduce", 1, 2.0, numel=4)]
    fusion = fuse(b.trace().events, fr)
    assert fusion.misaligned == {"0": 2} and set(fusion.done) == {0} and fusion.unknown == {1, 2}
    t = tracker(lambda group, raw: raw.startswith("_c10d_functional"))
    t.feed(record(0, 0, 1, raw="_c10d_functional::all_reduce") + record(1, 0, 2, op="monitored_barrier")
           + record(2, 0, 3, raw="_c10d_functional::all_reduce"))
    assert t.resolve_states(fr, ["0"]) == [] and "no collective #3" in t.misaligned["0"]


def test_an_input_size_offset_between_identical_ops_is_caught():
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,), done=False).coll("all_reduce", (8,), done=False)
    fr = [FrEntry("0", 1, False, "all_reduce", 0, 1.0, numel=8), FrEntry("0", 2, False, "all_reduce", 1, None, numel=8)]
    fusion = fuse(b.trace().events, fr)
    assert fusion.misaligned == {"0": 1} and not fusion.done


def test_completed_after_a_pending_one_is_not_believed(tmp_path):
    b = TraceBuilder(0, 2)
    for _ in range(3):
        b.coll("all_reduce", (4,), done=False)
    fr = entries((1, "nccl:all_reduce", "completed"), (2, "nccl:all_reduce", "scheduled"),
                 (3, "nccl:all_reduce", "completed"))
    run = run_dir(tmp_path, [b], {0: dump_of(fr)})
    assert [s[2] for s in states(run, 0)] == ["done", "pending", "unknown"]
    assert any("#3 completed after an earlier collective it shows pending" in n for n in run.incomplete)


def test_a_p2p_batch_takes_its_coalesced_entrys_state_and_leaves_the_collective_alone(tmp_path):
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,), done=False)
    b.p2p("send", 1, done=False).p2p("recv", 1, done=False)
    b.coll("all_reduce", (4,), done=False)
    fr = [nccl_entry(0, 1, "nccl:all_reduce", state="scheduled"),
          nccl_entry(1, 1, "nccl:send 0->1", state="scheduled", is_p2p=True, p2p_seq=1),
          nccl_entry(2, 1, "nccl:recv 0<-1", state="scheduled", is_p2p=True, p2p_seq=1),
          nccl_entry(3, 1, "nccl:coalesced", state="completed", p2p_seq=1, sizes=()),
          nccl_entry(4, 2, "nccl:all_reduce", state="scheduled")]
    run = run_dir(tmp_path, [b], {0: dump_of(fr)})
    assert [s[2] for s in states(run, 0)] == ["pending", "done", "done", "pending"]


def test_single_p2p_entries_give_each_op_its_own_state_matched_per_peer(tmp_path):
    """A blocking dist.send / dist.recv on NCCL: one Flight Recorder entry each, with its own CUDA
    events; matched to the trace's p2p op by group, peer and per-peer order (FR counts per group)."""
    b = TraceBuilder(0, 2)
    b.p2p("send", 1, done=False).p2p("recv", 1, done=False).p2p("send", 1, done=False)
    fr = [nccl_entry(0, 0, "nccl:send 0->1", state="completed", is_p2p=True, p2p_seq=1),
          nccl_entry(1, 0, "nccl:recv 0<-1", state="completed", is_p2p=True, p2p_seq=2),
          nccl_entry(2, 0, "nccl:send 0->1", state="started", is_p2p=True, p2p_seq=3)]
    run = run_dir(tmp_path, [b], {0: dump_of(fr)})
    assert [s[2] for s in states(run, 0)] == ["done", "done", "pending"]
    stats = completion_stats(run.traces)
    assert (stats.p2p, stats.p2p_observed) == (3, 2)
    assert stats.to_dict()["p2p"] == {"events": 3, "observed": 2, "unknown": 1}


def test_a_p2p_entry_of_another_op_or_a_wrapped_buffer_leaves_it_unknown(tmp_path):
    b = TraceBuilder(0, 2)
    b.p2p("send", 1, done=False)
    fr = [nccl_entry(0, 0, "nccl:recv 0<-1", state="completed", is_p2p=True, p2p_seq=1)]  # not this op
    run = run_dir(tmp_path / "other", [b], {0: dump_of(fr)})
    assert [s[2] for s in states(run, 0)] == ["unknown"]
    b = TraceBuilder(0, 2)
    b.p2p("send", 1, done=False)
    fr = [nccl_entry(5, 0, "nccl:send 0->1", state="completed", is_p2p=True, p2p_seq=1)]  # ring buffer wrapped
    run = run_dir(tmp_path / "wrapped", [b], {0: dump_of(fr)})
    assert [s[2] for s in states(run, 0)] == ["unknown"]


def test_the_report_says_plainly_that_p2p_completion_is_unknown(tmp_path):
    """No Work and no Flight Recorder for the p2p ops (NCCL's batch_isend_irecv seen live): the
    completion summary says their completion is unknown, and implies nothing else."""
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,))
    b.p2p("send", 1, done=False).p2p("recv", 1, done=False)
    run = run_dir(tmp_path, [b], {})
    summary = completion_stats(run.traces).to_dict()["summary"]
    assert "p2p completion unknown for 2 of 2 send/recv ops" in summary, summary
    assert "not that they did not" in summary, summary
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,))
    b.p2p("send", 1)
    run = run_dir(tmp_path / "seen", [b], {})
    assert "p2p" not in completion_stats(run.traces).to_dict()["summary"]


def test_the_wait_for_graph_uses_flight_recorder_states(tmp_path):
    """An order inversion on NCCL: both ranks' collectives look incomplete in the traces (no Work);
    the dumps show where each one is stuck."""
    a, b = TraceBuilder(0, 2), TraceBuilder(1, 2)
    for r in (a, b):
        r.coll("all_reduce", (4,), done=False).coll("all_reduce", (4,), group=TP, done=False)
    a.coll("all_reduce", (8,), done=False).coll("all_reduce", (16,), group=TP, done=False)
    b.coll("all_reduce", (16,), group=TP, done=False).coll("all_reduce", (8,), done=False)
    fr0 = entries((1, "nccl:all_reduce", "completed"), (1, "nccl:all_reduce", "completed", "tp"),
                  (2, "nccl:all_reduce", "started"), (2, "nccl:all_reduce", "scheduled", "tp"))
    fr1 = entries((1, "nccl:all_reduce", "completed"), (1, "nccl:all_reduce", "completed", "tp"),
                  (2, "nccl:all_reduce", "started", "tp"), (2, "nccl:all_reduce", "scheduled"))
    for e in fr0[2:]:
        e["input_sizes"] = [[8]] if e["process_group"][0] == "0" else [[16]]
    for e in fr1[2:]:
        e["input_sizes"] = [[16]] if e["process_group"][0] == "1" else [[8]]
    run = run_dir(tmp_path, [a, b], {0: dump_of(fr0), 1: dump_of(fr1)})
    view = RunView(run)
    assert (blocked_event(view, 0).group.name, blocked_event(view, 0).seq) == ("0", 2)
    assert (blocked_event(view, 1).group.name, blocked_event(view, 1).seq) == ("1", 2)
    report = analyze(run)
    assert report.cycle is not None and {e.rank for e in report.cycle} == {0, 1}


def test_no_dumps_no_change(tmp_path):
    b = TraceBuilder(0, 2)
    b.coll("all_reduce", (4,), done=False)
    write_traces(tmp_path / "traces", b)
    run = load_run(tmp_path)
    assert [s[2] for s in states(run, 0)] == ["none"]
    assert not any("flight" in n.lower() for n in run.incomplete)


def test_op_aliases():
    assert compatible("reduce_scatter", "all_reduce")          # Gloo's emulated reduce_scatter
    assert compatible("all_gather", "all_gather_coalesced")    # functional all_gather_tensor on NCCL
    assert compatible("barrier", "barrier") and compatible("all_reduce", "coalesced")
    assert not compatible("all_reduce", "broadcast") and not compatible("broadcast", "all_reduce")


def test_entries_from_a_gloo_dump_use_retired_and_pg_status():
    dump = {"pg_status": {"0": {"last_completed_collective": 2}}, "entries": [
        {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "op_id": 1,
         "profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": True, "input_sizes": [[4]],
         "time_created_ns": 5 * 10**9, "is_p2p": False},
        {"record_id": 1, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 2, "op_id": 2,
         "profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": False, "input_sizes": [[4]],
         "time_created_ns": 6 * 10**9, "is_p2p": False},
        {"record_id": 2, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 3, "op_id": 3,
         "profiling_name": "gloo:broadcast", "state": "scheduled", "retired": False, "input_sizes": [[4]],
         "time_created_ns": 7 * 10**9, "is_p2p": False},
        "not an entry", {"record_id": "x"}]}
    got = entries_from_dump(dump)
    assert [(e.seq, e.op, e.done, e.numel) for e in got] == [(1, "all_reduce", 5.0, 4), (2, "all_reduce", 6.0, 4),
                                                            (3, "broadcast", None, 4)]


# ------------------------------------------------------------------------------ run time: LiveTracker

def record(i: int, g: int, seq: int, op: str = "all_reduce", raw: str = "c10d::allreduce_", thread: str = "MainThread",
           shape=(4,), p2p: bool = False) -> bytes:
    """A ``c`` line as the recorders write it (keys in their order)."""
    pseq = ',"pseq":1' if p2p else ""
    return (f'{{"k":"c","i":{i},"g":{g},"seq":{seq}{pseq},"s":0,"t":1.0,"op":"{op}","raw":"{raw}",'
            f'"in":[[{",".join(map(str, shape))}]],"out":[[4]],"dt":["float32"],"async":false,"th":"{thread}",'
            f'"ph":"other","step":0}}\n').encode()


GROUPS = b'{"k":"g","id":0,"name":"0","desc":"default_pg","ranks":[0,1]}\n{"k":"g","id":1,"name":"1","desc":"tp","ranks":[0,1]}\n'


def tracker(wanted=lambda group, raw: True) -> LiveTracker:
    t = LiveTracker(wanted)
    t.feed(GROUPS)
    return t


def active(*specs) -> list[FrEntry]:
    return [FrEntry(group, seq, False, op, 100 + i, None, numel=4) for i, (group, seq, op) in enumerate(specs)]


def test_tracker_follows_records_in_any_split_and_forgets_completed_ones():
    t = tracker()
    data = record(0, 0, 1) + record(1, 0, 2) + record(2, 1, 1) + record(3, 0, 2, op="send", p2p=True)
    t.feed(data[:37])
    assert t.last_event == -1
    t.feed(data[37:])
    assert t.last_event == 3 and sorted(t.pending["0"]) == [1, 2] and sorted(t.pending["1"]) == [1]
    t.feed(b'{"k":"d","t":2.0,"i":[1,2]}\n')
    assert sorted(t.pending["0"]) == [1] and "1" not in t.pending
    # a record written by another writer (keys in another order) goes through json
    t.feed(b'{"k":"c","g":0,"i":9,"seq":3,"op":"broadcast","raw":"c10d::broadcast_","in":[[2]],"th":"T"}\n')
    assert t.pending["0"][3].op == "broadcast" and t.last_event == 9 and t.parse_errors == 0


def test_tracker_follows_only_what_it_is_asked_to():
    t = tracker(lambda group, raw: raw.startswith("_c10d_functional"))
    t.feed(record(0, 0, 1) + record(1, 0, 2, raw="_c10d_functional::all_reduce"))
    assert list(t.pending["0"]) == [2]


def test_active_dump_proves_older_collectives_complete():
    t = tracker()
    t.feed(record(0, 0, 1) + record(1, 0, 2) + record(2, 0, 3) + record(3, 0, 4))
    tops = dict(t.top_seq)
    # seq 3 is still running: 1 and 2 are complete; 4 is after it
    done = t.resolve_active(active(("0", 3, "all_reduce"), ("0", 4, "all_reduce")), {"0": 4}, tops, settled=3,
                            window=2000)
    assert sorted(done) == [0, 1] and sorted(t.pending["0"]) == [3, 4]
    # nothing listed any more: 3 is complete; 4 is the thread's last op (it may still be launching)
    done = t.resolve_active([], {"0": 4}, tops, settled=3, window=2000)
    assert done == [2] and sorted(t.pending["0"]) == [4]
    assert t.resolve_active([], {"0": 4}, tops, settled=3, window=2000, final=True) == [3]


def test_active_dump_claims_nothing_without_proof():
    t = tracker()
    t.feed(record(0, 0, 1, thread="A") + record(1, 0, 2, thread="A") + record(2, 1, 1, thread="A"))
    tops = dict(t.top_seq)
    # issued less than a poll ago (settled before them)
    assert t.resolve_active([], {"0": 2, "1": 1}, tops, settled=-1, window=2000) == []
    # the backend has not counted seq 2 yet (between the record and the launch): group 0 waits;
    # group 1's only collective is its thread's latest op (its call may still be launching)
    assert t.resolve_active([], {"0": 1, "1": 1}, tops, settled=2, window=2000) == []
    assert t.resolve_active([], {"0": 2, "1": 1}, tops, settled=2, window=2000) == [0, 1]
    # a group whose counter the dump cannot be compared with (it moved during the poll)
    t.feed(record(3, 1, 2, thread="A") + record(4, 0, 3, thread="B"))
    assert t.resolve_active([], {"0": 3, "1": 2}, {"0": 2, "1": 1}, settled=4, window=2000) == []
    # the ring buffer may have dropped them: too many ops recorded since (the later ones completed
    # through their Work, so nothing recent of their groups proves them)
    t.feed(b"".join(record(10 + i, 0, 4 + i, thread="B") for i in range(600)))
    t.feed(b'{"k":"d","t":2.0,"i":[%s]}\n' % ",".join(str(10 + i) for i in range(600)).encode())
    assert t.resolve_active([], {"0": 603, "1": 2}, dict(t.top_seq), settled=700, window=2000) == []
    assert sorted(t.pending["0"]) == [3] and sorted(t.pending["1"]) == [1, 2]
    # with a larger ring buffer they are provable (but event 3: its thread issued nothing since)
    assert sorted(t.resolve_active([], {"0": 603, "1": 2}, dict(t.top_seq), settled=700, window=20000)) == [2, 4]


def test_listed_entry_with_another_op_disables_the_group():
    t = tracker()
    t.feed(record(0, 0, 1) + record(1, 0, 2) + record(2, 0, 3))
    tops = dict(t.top_seq)
    assert t.resolve_active(active(("0", 2, "broadcast")), {"0": 3}, tops, settled=2, window=2000) == []
    assert "0" in t.misaligned
    assert t.resolve_active([], {"0": 3}, tops, settled=2, window=2000, final=True) == []


def test_a_counter_that_keeps_disagreeing_disables_the_group():
    t = tracker()
    t.feed(record(0, 0, 1) + record(1, 0, 2))
    tops = dict(t.top_seq)
    for _ in range(3):
        assert t.resolve_active([], {"0": 5}, tops, settled=1, window=2000) == []
    assert "counter says 5" in t.misaligned["0"]


def test_full_dump_states_for_gloo_functional_collectives():
    t = tracker()
    t.feed(record(0, 0, 1, raw="_c10d_functional::all_reduce") + record(1, 0, 2, raw="_c10d_functional::all_reduce")
           + record(2, 0, 3, raw="_c10d_functional::all_reduce"))
    full = [FrEntry("0", 1, False, "all_reduce", 0, 1.0, numel=4), FrEntry("0", 2, False, "all_reduce", 1, 2.0, numel=4),
            FrEntry("0", 3, False, "all_reduce", 2, None, numel=4)]
    assert sorted(t.resolve_states(full, ["0"])) == [0, 1] and list(t.pending["0"]) == [3]


def test_pg_status_proves_collectives_the_ring_buffer_no_longer_bounds():
    """A burst on one group, then many ops elsewhere: too many ops since for the buffer rule, but
    the group's pg_status (last completed Work) proves them; not for a group with p2p ops."""
    t = tracker()
    t.feed(b"".join(record(i, 1, 1 + i, thread="A") for i in range(5)))
    t.feed(b"".join(record(10 + i, 0, 1 + i, thread="A") for i in range(600)))
    t.feed(b'{"k":"d","t":2.0,"i":[%s]}\n' % ",".join(str(10 + i) for i in range(600)).encode())
    tops = dict(t.top_seq)
    assert t.resolve_active([], {"0": 600, "1": 5}, tops, settled=700, window=2000) == []
    assert t.resolve_active([], {"0": 600, "1": 5}, tops, settled=700, window=2000,
                            last_completed={"1": 4}) == [0, 1, 2, 3]
    t.feed(record(700, 1, 5, op="send", p2p=True) + record(701, 1, 6, thread="A"))
    tops = dict(t.top_seq)
    assert t.resolve_active([], {"0": 600, "1": 6}, tops, settled=701, window=2000, last_completed={"1": 6}) == []


def test_full_nccl_dump_waits_for_the_launching_thread():
    t = tracker()
    t.feed(record(0, 0, 1, thread="A") + record(1, 0, 2, thread="A"))
    full = [FrEntry("0", 1, False, "all_reduce", 0, 1.0, numel=4), FrEntry("0", 2, False, "all_reduce", 1, 2.0, numel=4)]
    assert t.resolve_states(full, ["0"], launched=True) == [0]
    assert t.resolve_states(full, ["0"]) == [1]


# ------------------------------------------------------------------------------ run time: the poller's glue

class _FakeGroup:
    def __init__(self, count: int):
        self.count = count

    def _get_sequence_number_for_group(self):
        return self.count


class _FakeRecorder:
    def __init__(self, run_dir, groups):
        self.run_dir, self._rank, self.groups = run_dir, 0, groups
        self.records = types.SimpleNamespace(write_locked=self._write)
        self.written: list[bytes] = []

    def process_group(self, name):
        return self.groups.get(name)

    def _write(self, data: bytes) -> None:
        self.written.append(data)
        with open(self.run_dir / "traces" / "rank-00000.jsonl", "ab") as f:
            f.write(data)


def test_poller_learns_pg_ids_from_a_full_dump_and_uses_pg_status(tmp_path, monkeypatch):
    import pickle

    from moedoctor.recorder import fr_poller

    (tmp_path / "traces").mkdir()
    trace = tmp_path / "traces" / "rank-00000.jsonl"
    trace.write_bytes(b'{"format":"moedoctor-trace","version":1}\n' + GROUPS
                      + b"".join(record(i, 1, 1 + i) for i in range(5)) + record(5, 0, 1))
    recorder = _FakeRecorder(tmp_path, {"0": _FakeGroup(1), "1": _FakeGroup(5)})
    dumps = []

    def dump(includeCollectives=True, includeStackTraces=True, onlyActive=False):
        dumps.append(onlyActive)
        entries = [] if onlyActive else [nccl_entry(0, 5, "nccl:all_reduce", pg=("1", "tp"), pg_id=7, state="completed")]
        return pickle.dumps({"pg_status": {"7": {"last_completed_collective": 5}, "0": {"last_completed_collective": 1}},
                             "entries": entries})

    poller = fr_poller.FlightRecorderPoller(recorder)
    poller._backends.update({"0": "nccl", "1": "nccl"})
    poller._groups.update(recorder.groups)
    poller._dump_nccl, poller._dump_generic = dump, None
    poller.off = False
    poller.poll()                  # nothing settled yet
    assert dumps == [True] and not recorder.written
    poller._next = 0.0
    poller.poll()  # a full dump (group 1's pg_id is unknown): its pg_status proves group 1's #1..#5; group 0's
    assert dumps == [True, False]  # only op is its thread's latest and its pg_id unknown: not proven
    record_line = json.loads(recorder.written[0])
    assert record_line["src"] == "fr" and record_line["i"] == [0, 1, 2, 3, 4]
    assert poller._pg_ids == {"1": "7"} and not poller.tracker.pending.get("1")


def test_tracker_skip_reads_only_group_records_and_drops_what_it_followed():
    t = tracker()
    t.feed(record(0, 0, 1) + record(1, 0, 2))
    assert sorted(t.pending["0"]) == [1, 2]
    passed = record(2, 0, 3) + b'{"k":"g","id":2,"name":"2","desc":"ep","ranks":[0,1]}\n' + record(3, 2, 1)
    cut = len(passed) - 20  # the skipped bytes end inside a record: it is followed from the tail on
    t.skip(passed[:cut])
    assert not t.pending and t.skipped == 2 and t.parse_errors == 0
    t.feed(passed[cut:] + record(4, 2, 2) + record(5, 0, 4))
    assert sorted(t.pending["2"]) == [1, 2] and sorted(t.pending["0"]) == [4]
    assert t.top_seq == {"0": 4, "2": 2} and t.last_event == 5


def test_poller_follows_only_the_tail_of_a_long_backlog(tmp_path):
    """A poll's cost must not grow with the backlog (it sets the next interval): with a ring buffer
    of 10 entries only the last 10 * TAIL_PER_ENTRY bytes are parsed, and groups are still known."""
    from moedoctor.recorder import fr_poller

    (tmp_path / "traces").mkdir()
    trace = tmp_path / "traces" / "rank-00000.jsonl"
    body = b"".join(record(i, 1, 1 + i) for i in range(20_000))
    trace.write_bytes(b'{"format":"moedoctor-trace","version":1}\n' + GROUPS + body)
    poller = fr_poller.FlightRecorderPoller(_FakeRecorder(tmp_path, {"0": _FakeGroup(0), "1": _FakeGroup(20_000)}))
    poller._backends.update({"0": "nccl", "1": "nccl"})
    poller.window = 10
    poller._read_tail()
    followed = poller.tracker.pending["1"]
    assert 0 < len(followed) <= 10 * fr_poller.TAIL_PER_ENTRY // 150
    assert max(followed) == 20_000 and poller.tracker.top_seq["1"] == 20_000
    assert poller.tracker.last_event == 19_999 and poller.tracker.skipped > 19_000
    assert poller._offset == trace.stat().st_size


# ------------------------------------------------------------------------------ run time: p2p ops


def p2p_record(i: int, seq: int, op: str, peer: int, pseq: int, thread: str = "MainThread") -> bytes:
    raw = "c10d::send" if op == "send" else "c10d::recv_"
    return (f'{{"k":"c","i":{i},"g":0,"seq":{seq},"pseq":{pseq},"s":0,"t":1.0,"op":"{op}","raw":"{raw}",'
            f'"in":[[4]],"out":[],"dt":["float32"],"async":true,"th":"{thread}","ph":"other","step":0,'
            f'"peer":{peer}}}\n').encode()


def batch_dump(*, first_record: int = 0, state: str = "completed") -> dict:
    """Rank 0's Flight Recorder after an all_reduce and one batch_isend_irecv with rank 1."""
    return dump_of([
        nccl_entry(first_record, 1, "nccl:all_reduce", state="completed"),
        nccl_entry(first_record + 1, 1, "nccl:send 0->1", state="scheduled", is_p2p=True, p2p_seq=1),
        nccl_entry(first_record + 2, 1, "nccl:recv 0<-1", state="scheduled", is_p2p=True, p2p_seq=1),
        nccl_entry(first_record + 3, 1, "nccl:coalesced", state=state, p2p_seq=1, sizes=()),
    ])


def test_tracker_follows_p2p_ops_and_a_full_dump_proves_a_batch_complete():
    """NCCL's batch_isend_irecv: each send/recv has a null Work, so the recorder never sees it
    complete; the batch's coalesced entry in a full dump does."""
    t = tracker()
    t.feed(record(0, 0, 1) + p2p_record(1, 1, "send", 1, 1) + p2p_record(2, 1, "recv", 1, 2))
    assert sorted(t.p2p_pending) == [1, 2] and t.p2p_pending[1].peer == 1 and t.has_pending(["0"])
    assert t.resolve_p2p(entries_from_dump(batch_dump(state="started")), ["0"]) == []  # not yet
    assert sorted(t.resolve_p2p(entries_from_dump(batch_dump()), ["0"])) == [1, 2]
    assert not t.p2p_pending


def test_p2p_ops_stay_unknown_past_the_ring_buffer_or_under_another_op():
    t = tracker()
    t.feed(record(0, 0, 1) + p2p_record(1, 1, "send", 1, 1) + p2p_record(2, 1, "recv", 1, 2))
    assert t.resolve_p2p(entries_from_dump(batch_dump(first_record=2000)), ["0"]) == []  # wrapped
    swapped = batch_dump()
    swapped["entries"][1]["profiling_name"], swapped["entries"][2]["profiling_name"] = "nccl:recv 0<-1", "nccl:send 0->1"
    assert t.resolve_p2p(entries_from_dump(swapped), ["0"]) == []
    assert sorted(t.p2p_pending) == [1, 2]
    # while the job runs: only an op whose thread issued a later one (the recv, the thread's last, waits)
    assert t.resolve_p2p(entries_from_dump(batch_dump()), ["0"], launched=True) == [1]
    assert sorted(t.p2p_pending) == [2]


def test_poller_decides_p2p_ops_at_its_last_poll_from_a_full_dump(tmp_path):
    import pickle

    from moedoctor.recorder import fr_poller

    (tmp_path / "traces").mkdir()
    trace = tmp_path / "traces" / "rank-00000.jsonl"
    trace.write_bytes(b'{"format":"moedoctor-trace","version":1}\n' + GROUPS + record(0, 0, 1)
                      + b'{"k":"d","t":2.0,"i":[0]}\n' + p2p_record(1, 1, "send", 1, 1) + p2p_record(2, 1, "recv", 1, 2))
    recorder = _FakeRecorder(tmp_path, {"0": _FakeGroup(1)})
    dumps = []

    def dump(includeCollectives=True, includeStackTraces=True, onlyActive=False):
        dumps.append(onlyActive)
        return pickle.dumps(batch_dump())

    poller = fr_poller.FlightRecorderPoller(recorder)
    poller._backends.update({"0": "nccl"})
    poller._groups.update(recorder.groups)
    poller._dump_nccl, poller._dump_generic = dump, None
    poller.off = False
    poller.poll()
    assert dumps == [] and not recorder.written, "p2p ops alone: no dump until the last poll"
    poller.poll(final=True)
    assert dumps == [False]
    assert json.loads(recorder.written[0])["i"] == [1, 2] and not poller.tracker.p2p_pending
