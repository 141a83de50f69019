"""The stacks-only report of ``moedoctor triage``, from synthetic py-spy dumps."""

from __future__ import annotations

import subprocess
import sys

from moedoctor.analysis.from_stacks import classify_stacks, read_rank_stack, report_from_stacks
from moedoctor.analysis.model import Verdict
from moedoctor.runner.stacks import Frame, StackDump

TORCH = "/venv/lib/python3.11/site-packages/torch"
C10D = f"{TORCH}/distributed/distributed_c10d.py"
LOGGER = f"{TORCH}/distributed/c10d_logger.py"
FSDP = f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
TRAIN = "/job/train.py"


def in_collective(op: str, line: int, fn: str = "train_step", torch_line: int = 3252, api: str | None = None):
    frames = [Frame(op, C10D, torch_line)]
    if api:
        frames.append(Frame(api, C10D, 3000))
    return (*frames, Frame("wrapper", LOGGER, 83), Frame(fn, TRAIN, line), Frame("main", TRAIN, 90),
            Frame("<module>", TRAIN, 100))


def dump(rank: int, frames=(), error: str | None = None) -> StackDump:
    return StackDump(rank=rank, pid=1000 + rank, error=error, main_thread=tuple(frames))


def test_identical_stacks_are_one_class_stuck_in_one_collective():
    stacks = {r: dump(r, in_collective("all_reduce", 53, torch_line=3252 + r)) for r in range(4)}
    classes = classify_stacks(stacks)
    assert [c.ranks for c in classes] == [(0, 1, 2, 3)]  # torch line numbers do not split a class
    report = report_from_stacks(stacks, source="x", world_size=4)
    assert report.verdict == Verdict.STUCK
    assert report.pattern is None and report.culprit_ranks == []
    assert "Stuck in one collective" in report.summary and "all_reduce" in report.summary
    assert report.problem_found


def test_one_rank_outside_any_collective_is_a_straggler():
    stacks = {r: dump(r, in_collective("all_reduce", 53)) for r in (0, 2, 3)}
    stacks[1] = dump(1, (Frame("_read_shard", TRAIN, 43), Frame("__next__", TRAIN, 36), Frame("main", TRAIN, 71)))
    report = report_from_stacks(stacks, source="x", world_size=4)
    assert report.verdict == Verdict.STUCK
    assert report.pattern == "straggler"
    assert report.culprit_ranks == [1]
    assert "_read_shard (train.py:43)" in report.summary and "ranks 0,2,3" in report.summary
    assert report.suggestion.call_site == f"{TRAIN}:43"
    summaries = {r.rank: r for r in report.ranks}
    assert summaries[1].in_collective is False and summaries[0].in_collective is True


def test_different_collectives_are_a_code_desync_with_the_odd_one_out():
    stacks = {r: dump(r, in_collective("all_reduce", 45, fn="_global_grad_norm")) for r in (0, 1, 2)}
    stacks[3] = dump(3, (Frame("all_gather_into_tensor", C10D, 4394), Frame("wrapper", LOGGER, 83),
                         Frame("foreach_all_gather", FSDP, 364), Frame("main", TRAIN, 69)))
    report = report_from_stacks(stacks, source="x")
    assert report.verdict == Verdict.DESYNC
    assert "different collectives" in report.summary
    assert "all_reduce" in report.summary and "all_gather_into_tensor" in report.summary
    assert report.culprit_ranks == [3]


def test_two_ranks_in_different_collectives_name_no_culprit():
    stacks = {0: dump(0, in_collective("all_gather", 36, api="all_gather_object")),
              1: dump(1, in_collective("gather", 83, api="gather_object"))}
    report = report_from_stacks(stacks, source="x")
    assert report.verdict == Verdict.DESYNC and report.culprit_ranks == []
    assert "all_gather_object -> all_gather" in report.summary and "gather_object -> gather" in report.summary


def test_same_collective_from_different_call_sites_is_a_desync():
    stacks = {0: dump(0, in_collective("all_reduce", 35)), 1: dump(1, in_collective("all_reduce", 53))}
    report = report_from_stacks(stacks, source="x")
    assert report.verdict == Verdict.DESYNC
    assert "all_reduce from different call sites" in report.summary


def test_no_rank_in_a_collective_is_not_a_collective_hang():
    stacks = {r: dump(r, (Frame("compute", TRAIN, 10), Frame("main", TRAIN, 20))) for r in (0, 1)}
    report = report_from_stacks(stacks, source="x")
    assert report.verdict == Verdict.HEALTHY and not report.problem_found


def test_a_stopped_rank_in_the_same_collective_is_rank_stopped():
    stacks = {r: dump(r, in_collective("all_reduce", 42)) for r in (0, 1)}
    report = report_from_stacks(stacks, source="x", states={0: "S", 1: "T"})
    assert report.pattern == "rank-stopped" and report.culprit_ranks == [1]
    assert any("state T" in e for e in report.evidence)
    assert report.suggestion.call_site is None and "kill -CONT 1001" in report.suggestion.text


def test_a_stopped_rank_outside_any_collective_is_rank_stopped_not_a_straggler():
    """SIGSTOP in the job's own code: its stack is outside any collective, like a straggler's, but
    it does not run at all; the readings recorded with the dump say so."""
    from moedoctor.runner.procs import ProcessState

    stacks = {0: dump(0, in_collective("all_reduce", 53)), 1: dump(1, (Frame("main", TRAIN, 48),))}
    stacks[1].process = ProcessState("TTTT", "do_signal_stop", 0.2)
    stacks[0].process = ProcessState("SSSS", None, 0.2)
    report = report_from_stacks(stacks, source="x")
    assert report.pattern == "rank-stopped" and report.verdict == Verdict.STUCK and report.culprit_ranks == [1]
    assert "rank 0 waits in all_reduce" in report.summary and "Not a code desync" in report.summary


def test_ranks_in_different_collectives_with_one_stopped_are_not_called_a_desync():
    stacks = {0: dump(0, in_collective("all_reduce", 45)), 1: dump(1, in_collective("all_gather", 69))}
    report = report_from_stacks(stacks, source="x", states={0: "S", 1: "D"})
    assert report.pattern == "rank-stopped" and report.verdict == Verdict.STUCK
    assert "uninterruptible sleep" in report.summary and "dmesg" in report.suggestion.text


def test_unreadable_and_absent_ranks_are_listed_as_incomplete():
    stacks = {0: dump(0, in_collective("all_reduce", 53)), 1: dump(1, error="py-spy has no permission. fix it")}
    report = report_from_stacks(stacks, source="x", world_size=4)
    assert any("rank 1: no stack (py-spy has no permission" in line for line in report.incomplete)
    assert any("ranks 1,2,3 (of world size 4)" in line for line in report.incomplete)
    assert "another node" in report.summary


def test_wait_in_a_library_wait_counts_as_in_collective_and_user_code_does_not():
    assert read_rank_stack(dump(0, (Frame("foreach_all_gather_copy_out", FSDP, 400), Frame("f", TRAIN, 1)))
                           ).collective == "foreach_all_gather_copy_out"
    # a blocked Work.wait() called from the job's own code shows no Python frame of torch: outside
    assert read_rank_stack(dump(0, (Frame("f", TRAIN, 1),))).collective is None


def test_from_stacks_imports_no_torch():
    code = "import sys, moedoctor.analysis.from_stacks; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- the Flight Recorder debug pipe (moedoctor.triage.flight_recorder) ---------------------------

def test_flight_recorder_pipe_without_reader_never_blocks(tmp_path):
    import os

    from moedoctor.triage.flight_recorder import trigger_dumps

    os.mkfifo(tmp_path / "fr_1.pipe")
    env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "fr_"),
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "dump_")}
    result = trigger_dumps({0: (os.getpid(), env), 1: (os.getpid(), env)}, tmp_path / "out", wait=0.5)
    assert result.enabled and not result.dumps
    assert any("fr_0.pipe does not exist" in n for n in result.notes)
    assert any("fr_1.pipe has no reader" in n for n in result.notes)


def test_flight_recorder_pipe_triggers_a_dump_that_is_collected(tmp_path):
    """A stand-in for the NCCL heartbeat monitor: reads the pipe, then writes the dump file."""
    import os
    import threading
    import time

    from moedoctor.triage.flight_recorder import trigger_dumps

    pipe, dump_file = tmp_path / "fr_0.pipe", tmp_path / "dump_0"
    os.mkfifo(pipe)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)

    def monitor():
        for _ in range(50):
            try:
                if os.read(fd, 128):
                    dump_file.write_bytes(b"\x80\x02}q\x00.")
                    return
            except BlockingIOError:
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=monitor)
    thread.start()
    env = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "fr_"),
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "dump_")}
    try:
        result = trigger_dumps({0: (os.getpid(), env)}, tmp_path / "out", wait=3.0)
    finally:
        thread.join()
        os.close(fd)
    assert result.dumps == {0: tmp_path / "out" / "fr_rank_0"}
    assert (tmp_path / "out" / "fr_rank_0").read_bytes() == b"\x80\x02}q\x00."
