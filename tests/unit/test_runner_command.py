"""Which launcher commands ``moedoctor run`` accepts, and which run directories it uses."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from moedoctor.errors import EXIT_USAGE, MoedoctorError
from moedoctor.runner.command import check_launcher, check_torchrun, is_torchrun, same_job
from moedoctor.runner.launch import _torchrun_failures
from moedoctor.runner.manifest import root_cause_rank
from moedoctor.runner.rundir import default_run_dir, prepare_run_dir

TORCHRUN = ["torchrun", "--nproc_per_node=2", "train.py"]


@pytest.mark.parametrize("command", [
    TORCHRUN,
    ["/usr/local/bin/torchrun", "--standalone", "train.py", "--lr", "1"],
    ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py"],
    ["python3", "-m", "torch.distributed.run", "train.py"],
    ["/opt/venv/bin/python3.11", "-u", "-m", "torch.distributed.run", "train.py"],
])
def test_accepts_torchrun_launchers(command):
    assert check_launcher(command) == command and is_torchrun(command)
    assert check_torchrun(command) == command


OTHERS = [
    ["python", "train.py"], ["python", "-m", "torch.distributed.launch", "train.py"],
    ["bash", "-c", "torchrun train.py"], ["mpirun", "-n", "2", "python", "train.py"],
    ["accelerate", "launch", "--num_processes", "2", "train.py"], ["python", "ray_driver.py"],
]


@pytest.mark.parametrize("command", OTHERS)
def test_run_accepts_any_other_command_as_the_jobs_root(command):
    assert check_launcher(command) == command and not is_torchrun(command)


@pytest.mark.parametrize("command", [*OTHERS, []])
def test_verify_still_wraps_torchrun_only(command):
    with pytest.raises(MoedoctorError) as e:
        check_torchrun(command)
    assert e.value.exit_code == EXIT_USAGE and "torchrun" in e.value.message


def test_run_refuses_no_command():
    with pytest.raises(MoedoctorError) as e:
        check_launcher([])
    assert e.value.exit_code == EXIT_USAGE and "any command" in e.value.message


def test_nodes_of_one_job_differ_only_in_node_rank():
    a = ["torchrun", "--nnodes=2", "--node_rank=0", "train.py"]
    assert same_job(a, ["torchrun", "--nnodes=2", "--node_rank=1", "train.py"])
    assert same_job(["torchrun", "--node-rank", "0", "t.py"], ["torchrun", "--node-rank", "1", "t.py"])
    assert not same_job(a, ["torchrun", "--nnodes=2", "--node_rank=1", "other.py"])


def test_default_run_dir_is_new_and_timestamped(tmp_path):
    now = datetime(2025, 1, 2, 3, 4, 5)
    first = default_run_dir(tmp_path, now)
    assert first == tmp_path / "20250102-030405"
    first.mkdir()
    assert default_run_dir(tmp_path, now) == tmp_path / "20250102-030405-2"


def test_refuses_a_non_empty_run_dir_without_force(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(MoedoctorError, match="--force"):
        prepare_run_dir(tmp_path, TORCHRUN, force=False)
    assert prepare_run_dir(tmp_path, TORCHRUN, force=True) is False
    assert not (tmp_path / "traces").exists() and (tmp_path / "notes.txt").exists()


NODE0 = ["torchrun", "--nnodes=2", "--node_rank=0", "--rdzv_id=7", "train.py"]
NODE1 = ["torchrun", "--nnodes=2", "--node_rank=1", "--rdzv_id=7", "train.py"]


def hold_lock(path, pid=4242, host="otherhost"):
    """Hold a supervisor's lock as another live moedoctor would (another open file description)."""
    import fcntl
    import os

    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{pid} {host}\n".encode())
    return fd


def test_joins_a_running_run_of_the_same_job_from_another_node(tmp_path):
    import os

    from moedoctor.runner.rundir import lock_path

    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running", "command": NODE0}))
    fd = hold_lock(lock_path(tmp_path, NODE0))
    try:
        assert prepare_run_dir(tmp_path, NODE1, force=False) is True  # another node of the same job
        with pytest.raises(MoedoctorError, match="pid 4242 on otherhost") as e:  # the same node again
            prepare_run_dir(tmp_path, NODE0, force=False)
        assert e.value.exit_code == EXIT_USAGE
        with pytest.raises(MoedoctorError, match="pid 4242"):  # --force never replaces a live run
            prepare_run_dir(tmp_path, NODE0, force=True)
        with pytest.raises(MoedoctorError, match="live run"):  # another job
            prepare_run_dir(tmp_path, ["torchrun", "--node_rank=3", "other.py"], force=False)
    finally:
        os.close(fd)  # the supervisor dies: the kernel drops its lock


def test_a_running_manifest_without_a_live_supervisor_is_stale(tmp_path):
    from moedoctor.runner.rundir import lock_path, release

    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running", "command": TORCHRUN}))
    (tmp_path / "traces").mkdir()
    lock_path(tmp_path, TORCHRUN).write_text("999999 gone\n")  # left by a kill -9'd supervisor, not held
    with pytest.raises(MoedoctorError, match="no supervisor holds it"):
        prepare_run_dir(tmp_path, TORCHRUN, force=False)
    with pytest.raises(MoedoctorError, match="not empty"):
        prepare_run_dir(tmp_path, NODE1, force=False)  # not joined either
    assert prepare_run_dir(tmp_path, TORCHRUN, force=True) is False
    assert not (tmp_path / "traces").exists()
    release(lock_path(tmp_path, TORCHRUN))


def test_a_finished_run_is_not_joined(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "finished", "command": TORCHRUN}))
    with pytest.raises(MoedoctorError):
        prepare_run_dir(tmp_path, TORCHRUN, force=False)


def test_reads_exit_codes_from_torchrun_failure_report():
    log = """
Failures:
[1]:
  time      : 2025-01-01_00:00:00
  host      : node0
  rank      : 3 (local_rank: 1)
  exitcode  : -6 (pid: 4242)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_00:00:00
  host      : node0
  rank      : 2 (local_rank: 0)
  exitcode  : 3 (pid: 4241)
"""
    assert _torchrun_failures(log) == {3: -6, 2: 3}
    assert root_cause_rank(log) == 2  # torchrun's "first observed failure"
    assert root_cause_rank(log.split("Root Cause")[0]) is None


def test_a_node_starting_at_the_same_moment_joins(tmp_path):
    """Both nodes started at once: the other one holds its lock but has not written the manifest yet."""
    import os

    from moedoctor.runner.rundir import lock_path, release

    fd = hold_lock(lock_path(tmp_path, NODE0))
    try:
        assert prepare_run_dir(tmp_path, NODE1, force=False) is True
    finally:
        os.close(fd)
        release(lock_path(tmp_path, NODE1))
    assert prepare_run_dir(tmp_path / "fresh", NODE0, force=False) is False  # nobody else: a new run
    release(lock_path(tmp_path / "fresh", NODE0))


def test_a_diagnosing_node_waits_for_the_other_nodes_stacks(tmp_path):
    """In a shared run directory a node reports once every other running node recorded its hang
    (its ranks' stacks), or after peer_wait."""
    import time

    from moedoctor.runner.launch import RunConfig, RunObserver, _Run

    run = _Run(RunConfig(command=NODE0, run_dir=tmp_path, env={}, peer_wait=0.6), RunObserver())
    other = {"status": "running", "hang": None}
    (tmp_path / "manifest.json").write_text(json.dumps({"nodes": {run.node.node: {"status": "hang"}, "b:1": other}}))
    start = time.monotonic()
    run._await_peers()
    assert time.monotonic() - start >= 0.6  # the other node never recorded its hang: waited peer_wait
    other["hang"] = {"ranks": []}
    (tmp_path / "manifest.json").write_text(json.dumps({"nodes": {"b:1": other}}))
    start = time.monotonic()
    run._await_peers()
    assert time.monotonic() - start < 0.3
