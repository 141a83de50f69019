"""Stack dumps: py-spy's JSON parsed, its failures explained; the job's processes found and stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moedoctor.runner import procs, stacks
from moedoctor.runner.procs import ProcessState
from moedoctor.runner.stacks import PTRACE_HELP, StackTarget, _explain, dump_stacks, find_py_spy, read_stack_dump


def frame(name, file, line):
    return {"name": name, "filename": file, "line": line, "short_filename": file.rsplit("/", 1)[-1]}


def test_main_thread_and_user_frame_of_a_dump(tmp_path):
    threads = [
        {"pid": 7, "os_thread_id": 9, "thread_name": "moedoctor-progress",
         "frames": [frame("wait", "/usr/lib/python3.11/threading.py", 331)]},
        {"pid": 7, "os_thread_id": 7, "thread_name": "MainThread", "frames": [
            frame("0x7f00", "/usr/lib/libc.so.6", 0),
            frame("all_reduce", "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3252),
            frame("train_step", "/job/train.py", 42), frame("<module>", "/job/train.py", 99)]},
    ]
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"rank": 0, "pid": 7, "host": "h", "threads": threads}))
    dump = read_stack_dump(path)
    assert str(dump.waiting_in) == "all_reduce (distributed_c10d.py:3252)"  # native frames skipped
    assert str(dump.user_frame) == "train_step (train.py:42)"
    assert set(dump.threads) == {"moedoctor-progress", "MainThread"}


DENIED = "Permission Denied: Try running again with elevated permissions by going 'sudo env'"
#: What py-spy 0.4 prints when it attaches (without --nonblocking) to a SIGSTOPped process.
STOPPED_ERROR = """Error: Failed to get stack traces

Caused by:
    0: Failed to suspend process
    1: unexpected waitpid result PtraceEvent(Pid(6517), SIGSTOP, 128) to 6517

Stack backtrace:
   0: <E as anyhow::context::ext::StdError>::ext_context
"""


def test_missing_ptrace_permission_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(stacks, "ptrace_capable", lambda: False)
    monkeypatch.setattr(stacks.os, "geteuid", lambda: 1000)
    message = _explain(DENIED, 42)
    assert "pid 42" in message and PTRACE_HELP in message and "SYS_PTRACE" in message
    assert "ptrace" not in _explain("Error: Failed to find python version from target process", 42)


def test_root_is_never_told_to_run_as_root(monkeypatch):
    monkeypatch.setattr(stacks.os, "geteuid", lambda: 0)
    monkeypatch.setattr(stacks, "ptrace_capable", lambda: False)  # root in a container without SYS_PTRACE
    message = _explain(DENIED, 42)
    assert "as root" in message and "run moedoctor as root" not in message and "--cap-add SYS_PTRACE" in message
    monkeypatch.setattr(stacks, "ptrace_capable", lambda: True)  # root with the capability
    message = _explain(DENIED, 42)
    assert "may trace any process" in message and "run moedoctor as root" not in message


def test_a_stopped_process_is_said_to_be_stopped_not_unreadable_for_permission():
    state = ProcessState("TTT", "do_signal_stop", 0.1)
    message = _explain(STOPPED_ERROR, 42, state)
    assert "the process is stopped (state T" in message and "permission" not in message.lower()
    assert "unexpected waitpid result" in message  # py-spy's own words, its causes on one line
    assert "permission" not in _explain(STOPPED_ERROR, 42).lower()  # the bare word "ptrace" is no hint


def test_a_sigstopped_process_is_read_without_waking_it_and_its_state_recorded(tmp_path):
    """The runner's dump: /proc state first (several readings), then py-spy --nonblocking, which
    never attaches; the process is still stopped afterwards and the record says so."""
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    script = tmp_path / "stuck.py"
    script.write_text("import time\ndef stuck_here():\n    while True: time.sleep(0.05)\nstuck_here()\n")
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        (dump,) = dump_stacks([StackTarget(3, proc.pid)], tmp_path / "stacks", "host")
        record = json.loads((tmp_path / "stacks" / "rank-3.json").read_text())
        assert record["nonblocking"] is True and record["process"]["state"] == "T", record
        assert set(record["process"]["samples"]) == {"T"} and len(record["process"]["samples"]) == 4
        assert dump.frozen == "T" and dump.error is None, dump.error
        assert "stuck_here" in [f.function for f in dump.main_thread]
        assert procs.stat(proc.pid)[1] == "T"  # not woken
        assert read_stack_dump(tmp_path / "stacks" / "rank-3.json").process == dump.process
    finally:
        proc.kill()
        proc.wait()


def test_no_stacks_still_records_the_process_state(tmp_path):
    (dump,) = dump_stacks([StackTarget(0, os.getpid())], tmp_path, "host", py_spy=False)
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert "threads" not in record and "--no-stacks" in record["error"]
    assert record["process"]["state"] in ("R", "S") and dump.frozen is None


def test_stopping_a_job_continues_a_stopped_process_so_it_ends_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        procs.stop_processes(lambda: procs.job_processes(proc.pid), grace=10.0)
        assert time.monotonic() - start < 5.0  # SIGTERM + SIGCONT, not the SIGKILL after the grace
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        proc.kill()


def test_stop_processes_reaches_workers_in_their_own_sessions(tmp_path):
    # A launcher whose child starts a new session, as torchrun's workers do; both ignore SIGTERM.
    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.setsid(); "
             "open(os.environ['READY'], 'w').close(); time.sleep(60)")
    launcher = (f"import os, subprocess, sys, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"subprocess.Popen([sys.executable, '-c', {child!r}], env={{**os.environ, 'RANK': '0'}}); "
                f"time.sleep(60)")
    ready = tmp_path / "ready"
    env = {"READY": str(ready), "MOEDOCTOR_TEST_MARK": "x1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        found = procs.job_processes(proc.pid)
        assert len(found) == 2 and procs.rank_processes(found)[0].ppid == proc.pid
        marker = ("MOEDOCTOR_TEST_MARK", "x1")
        signalled = procs.stop_processes(lambda: procs.job_processes(proc.pid, marker), grace=0.5)
        assert len(signalled) == 2
        proc.wait(timeout=5)
        assert procs.job_processes(proc.pid, marker) == []
    finally:
        proc.kill()


def test_a_damaged_process_record_costs_the_state_not_the_stack(tmp_path):
    threads = [{"pid": 7, "os_thread_id": 7, "thread_name": "MainThread", "frames": [frame("main", "/job/t.py", 3)]}]
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"rank": 0, "pid": 7, "threads": threads, "process": {"samples": ["T"]}}))
    dump = read_stack_dump(path)
    assert dump.process is None and dump.frozen is None and str(dump.user_frame) == "main (t.py:3)"
