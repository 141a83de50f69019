"""Stack dumps: py-spy's JSON parsed, its failures explained; the job's processes found and stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from moedoctor.runner import procs
from moedoctor.runner.stacks import PTRACE_HELP, _explain, read_stack_dump


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


def test_missing_ptrace_permission_says_how_to_fix():
    message = _explain("Permission Denied: Try running again with elevated permissions by going 'sudo env'", 42)
    assert "pid 42" in message and PTRACE_HELP in message and "SYS_PTRACE" in message
    assert "ptrace" not in _explain("Error: Failed to find python version from target process", 42)


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
