"""moedoctor's own writes failing (issue 12): the recorder stops recording and says so once, in its
status file or on stderr, and the job goes on (Python and native kernels, the trace capped with
RLIMIT_FSIZE, in one process on the fake backend); the status file's format; the supervisor's
side: the tracker reads the statuses, job.log, the manifest and the stacks survive a write that
fails, a read-only or full file system explains the traces' silence; the analysis takes a stopped
rank as open-ended and never calls it healthy. The real job on a full tmpfs is in
tests/integration/test_run_disk_full.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from event_factory import ranks, write_traces
from moedoctor.analysis.loading.load import evidence_problem, load_run
from moedoctor.runner import launch, manifest
from moedoctor.runner.manifest import NodeRecord, write_node
from moedoctor.runner.progress import ProgressTracker
from moedoctor.runner.stacks import StackTarget, dump_stacks
from moedoctor.trace import format as fmt

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "jobs" / "write_failure.py"


def run_job(run_dir: Path, kernels: str, limit: int) -> tuple[dict, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, str(JOB), str(run_dir), "--kernels", kernels, "--limit", str(limit)],
                            capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.fixture(params=["python", "native"])
def kernels(request):
    if request.param == "native":
        from moedoctor.recorder import native

        if not native.available():
            pytest.skip(f"native recorder extension cannot be built here: {native.reason[-400:]}")
    return request.param


def test_recorder_stops_on_a_failed_write_and_the_job_goes_on(kernels, tmp_path):
    out, stderr = run_job(tmp_path / "run", kernels, limit=8192)
    assert out["native"] == (kernels == "native")
    assert out["total"] == out["steps"]  # every collective ran, with its result
    assert out["stopped"] and "stopped recording: File too large (errno 27 EFBIG writing rank-00000.jsonl" in out["stopped"]
    assert not out["thread_errors"] and not out["progress_thread_died"]
    assert "Traceback" not in stderr and "stopped recording" not in stderr  # said in the status file instead
    status = fmt.read_statuses(tmp_path / "run" / "traces")[0]
    assert status["state"] == fmt.STOPPED and status["errno"] == errno.EFBIG
    assert fmt.stopped_line(status) == out["stopped"]
    trace = (tmp_path / "run" / "traces" / "rank-00000.jsonl").read_bytes()
    assert len(trace) == 8192
    complete = trace[:trace.rfind(b"\n") + 1].splitlines()
    assert all(json.loads(line) for line in complete)  # whole records up to the failure, then one cut short
    assert sum(json.loads(line).get("k") == "c" for line in complete[1:]) <= status["events"] < out["steps"]


def test_a_status_that_cannot_be_written_goes_to_stderr_once(tmp_path):
    out, stderr = run_job(tmp_path / "run", "python", limit=100)  # not even the status file fits
    assert stderr.count("stopped recording") == 1
    assert f"moedoctor: {out['stopped']}" in stderr and "after 0 collectives" in stderr
    assert not list((tmp_path / "run" / "traces").glob("*.status"))  # no half-written status left
    assert out["total"] == out["steps"] and not out["thread_errors"]


def test_status_records_have_one_size_and_read_back(tmp_path):
    fd = fmt.reserve_status(tmp_path, 3, 42)
    path = tmp_path / fmt.status_file_name(3)
    assert path.stat().st_size == fmt.STATUS_BYTES
    assert fmt.read_statuses(tmp_path)[3]["state"] == fmt.RECORDING
    fmt.stop_status(fd, 3, 42, OSError(errno.ENOSPC, "No space left on device"), "rank-00003.jsonl", 7)
    os.close(fd)
    assert path.stat().st_size == fmt.STATUS_BYTES  # rewritten in place: no new space needed
    status = fmt.read_statuses(tmp_path)[3]
    assert fmt.stopped_line(status) == ("rank 3 stopped recording: No space left on device (errno 28 ENOSPC writing "
                                        "rank-00003.jsonl, after 7 collectives; the job goes on, unrecorded)")
    long = fmt.encode_status(1, 1, fmt.STOPPED, error="x" * 5000, file="y" * 5000)
    assert len(long) == fmt.STATUS_BYTES and json.loads(long)["state"] == fmt.STOPPED


@pytest.mark.parametrize("content", [b"", b"{", b"\xff" * 10, b"[]", b'{"format":"moedoctor-recorder-status"}',
                                     json.dumps({"format": fmt.STATUS_FORMAT, "rank": 9, "state": "stopped"}).encode(),
                                     json.dumps({"format": fmt.STATUS_FORMAT, "rank": 0, "state": "x"}).encode(),
                                     b" " * (fmt.STATUS_BYTES + 1)])
def test_a_damaged_or_foreign_status_is_left_out(tmp_path, content):
    (tmp_path / fmt.status_file_name(0)).write_bytes(content)
    assert fmt.read_statuses(tmp_path) == {}


def test_tracker_reports_ranks_that_stopped_recording(tmp_path):
    tracker = ProgressTracker(tmp_path)
    fd = fmt.reserve_status(tmp_path, 1, 5)
    tracker.poll()
    assert tracker.stopped == {}
    fmt.stop_status(fd, 1, 5, OSError(errno.EDQUOT, "Disk quota exceeded"), "rank-00001.jsonl", 3)
    os.close(fd)
    tracker.poll()
    assert tracker.stopped[1].startswith("rank 1 stopped recording: Disk quota exceeded (errno 122 EDQUOT")


def test_job_log_that_cannot_be_written_is_reported_once(tmp_path):
    log_path = tmp_path / "job.log"
    log_path.symlink_to("/dev/full")  # every write: ENOSPC
    said = []
    with launch._JobLog(log_path, said.append) as log:
        log.write(b"hello\n")
        log.write(b"more\n")
    assert said == ["cannot write job.log: No space left on device (errno 28 ENOSPC); the job's output goes to "
                    "the screen only from here"]


def test_manifest_is_rewritten_in_place_when_the_disk_is_full(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    node = NodeRecord(node="h:1", host="h", moedoctor_pid=1, start=1.0)
    write_node(path, node, command=["torchrun"], versions={})

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manifest, "write_atomically", full)
    node.status, node.launcher_exit = "finished", 0
    write_node(path, node, command=["torchrun"], versions={})
    assert json.loads(path.read_text())["status"] == "finished"
    assert not list(tmp_path.glob(".manifest.json.*.tmp"))
    node.write_errors = ["x" * 10000]  # no longer fits in the blocks the manifest holds: refused, left whole
    with pytest.raises(OSError):
        write_node(path, node, command=["torchrun"], versions={})
    assert json.loads(path.read_text())["status"] == "finished"


def test_a_stack_that_cannot_be_written_is_kept_in_memory(tmp_path):
    (tmp_path / "rank-0.json").symlink_to("/dev/full")
    [dump] = dump_stacks([StackTarget(0, os.getpid())], tmp_path, "host", py_spy=False)
    assert dump.path is None and dump.process is not None
    assert dump.write_error.startswith("cannot write rank-0.json: No space left on device (errno 28 ENOSPC)")


class _StatVfs:
    def __init__(self, flag: int = 0, blocks: int = 100, bavail: int = 50):
        self.f_flag, self.f_blocks, self.f_bavail = flag, blocks, bavail


@pytest.mark.parametrize("stat, expected", [
    (_StatVfs(), None),
    (_StatVfs(flag=os.ST_RDONLY), "the run directory's file system is read-only"),
    (_StatVfs(bavail=0), "the run directory's file system is full (0 bytes free"),
])
def test_a_full_or_read_only_file_system_explains_the_silence(monkeypatch, tmp_path, stat, expected):
    monkeypatch.setattr(launch.os, "statvfs", lambda path: stat)
    found = launch._file_system_trouble(tmp_path)
    assert found == expected if expected is None else found.startswith(expected)


def test_a_rank_that_stopped_recording_is_open_ended_and_never_healthy(tmp_path):
    a, b = ranks(2)
    for r in (a, b):
        r.coll("all_reduce")
    a.coll("all_reduce", done=False)  # its completion was never written: the disk was full
    b.coll("all_reduce", done=False)  # still recording, and still in it (or slow to poll)
    folder = write_traces(tmp_path / "traces", a, b)
    fd = fmt.reserve_status(folder, 0, 100)
    fmt.stop_status(fd, 0, 100, OSError(errno.ENOSPC, "No space left on device"), "rank-00000.jsonl", 2)
    os.close(fd)
    run = load_run(folder)
    assert run.open_ended == {0} and "stopped recording" in run.recording_stopped[0]
    assert any("later collectives are not recorded" in line for line in run.incomplete)
    assert "the trace ends before the rank did, so healthy cannot be told" in evidence_problem(run)


def test_analyze_of_a_stopped_rank_is_bad_input_not_stuck(tmp_path):
    """Its last collective's completion was never written: without a hang declared while the job ran,
    that is the stop, not a hang."""
    test_a_rank_that_stopped_recording_is_open_ended_and_never_healthy(tmp_path)
    done = subprocess.run([sys.executable, "-m", "moedoctor", "analyze", str(tmp_path / "traces")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 0 stopped recording: No space left on device" in done.stderr
