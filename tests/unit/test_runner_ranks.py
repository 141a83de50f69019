"""Which processes of a launch are its ranks (``runner/ranks.py``): the traces (torch.distributed's
rank) first, ``RANK`` in the environment only for ranks with no trace yet; and what is known of
their exits under torchrun and under any other command."""

from __future__ import annotations

import json

from moedoctor.runner.procs import JobProcess
from moedoctor.runner.progress import RankProgress
from moedoctor.runner.ranks import rank_exits, ranks_of, unknown_exits_line


def traced(rank: int, pid: int, host: str = "h") -> RankProgress:
    return RankProgress(rank, host, pid, rank, 2, 0.0)


def test_ranks_come_from_the_traces_not_the_environment():
    # A Ray driver (100), its raylet (101) and two actors (102, 103) that set RANK at run time: no RANK
    # in /proc, and actor 102 became rank 1.
    processes = [JobProcess(100, 1, None, None, None), JobProcess(101, 100, None, None, None),
                 JobProcess(102, 101, None, None, None), JobProcess(103, 101, None, None, None)]
    found = ranks_of(processes, {1: traced(1, 102), 0: traced(0, 103)}, "h")
    assert {r: p.pid for r, p in found.items()} == {0: 103, 1: 102}
    assert found[1].world_size == 2 and found[1].ppid == 101


def test_a_trace_wins_over_a_misleading_rank_in_the_environment():
    # The root exported RANK=0 before spawning: every child inherits it, but torch.distributed made 11 rank 1.
    processes = [JobProcess(10, 1, 0, 0, 2), JobProcess(11, 10, 0, 0, 2), JobProcess(12, 10, 0, 0, 2)]
    found = ranks_of(processes, {1: traced(1, 11), 0: traced(0, 12)}, "h")
    assert {r: p.pid for r, p in found.items()} == {0: 12, 1: 11}


def test_torchrun_workers_without_a_trace_yet_are_found_by_rank():
    processes = [JobProcess(10, 1, None, None, None), JobProcess(11, 10, 0, 0, 2), JobProcess(12, 10, 1, 1, 2),
                 JobProcess(13, 12, 1, 1, 2)]  # 13: rank 1's data loader worker
    found = ranks_of(processes, {0: traced(0, 11)}, "h")
    assert {r: p.pid for r, p in found.items()} == {0: 11, 1: 12}


def test_other_hosts_and_other_launches_ranks_are_not_ours():
    processes = [JobProcess(10, 1, None, None, None), JobProcess(11, 10, None, None, None)]
    # rank 1's trace: same pid on another host (a shared run directory); rank 2's pid is not of this launch.
    found = ranks_of(processes, {0: traced(0, 11), 1: traced(1, 11, "other"), 2: traced(2, 99)}, "h")
    assert list(found) == [0]


def test_exits_under_torchrun_and_under_any_other_command():
    seen = {0: JobProcess(10, 1, 0, 0, 2), 1: JobProcess(11, 10, 1, 1, 2)}
    torchrun = {e.rank: (e.exit_code, e.source) for e in rank_exits(seen, 5, 0, True, {}, "h")}
    assert torchrun == {0: (0, "launcher"), 1: (0, "launcher")}
    failed = {e.rank: (e.exit_code, e.source) for e in rank_exits(seen, 5, 1, True, {1: -6}, "h")}
    assert failed == {0: (None, "unknown"), 1: (-6, "torchrun")}
    # Lightning: rank 0 is the command's own process (pid 10), rank 1 its child.
    other = {e.rank: (e.exit_code, e.source) for e in rank_exits(seen, 10, 0, False, {}, "h")}
    assert other == {0: (0, "root"), 1: (None, "unknown")}
    stopped = {e.source for e in rank_exits(seen, 10, None, False, {}, "h")}
    assert stopped == {"stopped"}


def test_the_report_line_names_the_ranks_whose_exit_is_unknown(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"ranks": {"0": {"rank": 0, "source": "root"}, "1": {"rank": 1, "source": "unknown"},
                                              "2": {"rank": 2, "source": "unknown"}}}))
    line = unknown_exits_line(manifest)
    assert line is not None and line.startswith("the exit status of ranks 1,2 is not known")
    manifest.write_text(json.dumps({"ranks": {"0": {"rank": 0, "source": "launcher"}}}))
    assert unknown_exits_line(manifest) is None
    assert unknown_exits_line(tmp_path / "missing.json") is None
