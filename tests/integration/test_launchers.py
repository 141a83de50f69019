"""``moedoctor run`` on launchers other than torchrun, for real (CPU, Gloo, 2 ranks): the job's
command is its root, every Python process under it loads the recorder, and a process is a rank once
it creates its default process group (rank and world size from torch.distributed, not from ``RANK``).

Each launcher has a healthy run (exit 0, no alarm, every rank's trace) and a fault that the job's own
code produces (a real hang or crash without moedoctor), diagnosed with its verdict, culprit and call
site, stacks dumped from the ranks found through their traces, and nothing left running after it.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from torchrun_util import FIXTURES, REPO, JobResult, job_env, live_processes, run_command

from moedoctor.errors import EXIT_HANG

LAUNCHERS = FIXTURES / "launchers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moedoctor_run(run_dir: Path, *command: str, timeout: float = 150.0, hang_timeout: str = "30") -> JobResult:
    cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", hang_timeout,
           "--", *command]
    return run_command(cmd, timeout, env=job_env(FIXTURE_PORT=str(free_port())), cwd=run_dir.parent)


def survivors(run_dir: Path) -> list[int]:
    mark = f"MOEDOCTOR_RUN_DIR={run_dir.resolve()}".encode()
    return live_processes(lambda proc: mark in (proc / "environ").read_bytes().split(b"\0"))


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def call_sites(rep: dict) -> list[str]:
    sites = []
    for div in [rep["divergence"]] if rep.get("divergence") else []:
        sites += [op["call_site"] for op in div["per_rank"].values() if op and op["call_site"]]
    return sites


def assert_healthy(run_dir: Path, result: JobResult) -> None:
    assert result.returncode == 0, result.tail()
    assert "DESYNC" not in result.output and "HANG" not in result.output, result.tail()
    rep = report(run_dir)
    assert rep["verdict"] == "healthy", (rep["summary"], result.tail())
    m = manifest(run_dir)
    assert m["status"] == "finished" and m["world_size"] == 2
    assert sorted(p.name for p in (run_dir / "traces").glob("rank-*.jsonl")) == ["rank-00000.jsonl",
                                                                                 "rank-00001.jsonl"]
    assert survivors(run_dir) == []


def assert_diagnosed(run_dir: Path, result: JobResult, verdict: str, culprits: list[int], site: str) -> dict:
    """``site``: the call site of a divergent collective, or the job's line the evidence names (a
    framework's own collective, such as ``accelerator.gather``, is called from the job's branch)."""
    assert result.returncode == EXIT_HANG, result.tail()
    rep = report(run_dir)
    context = (rep["summary"], rep["evidence"], result.tail(30))
    assert rep["verdict"] == verdict, context
    assert rep["culprit_ranks"] == culprits, context
    assert any(s.endswith(site) for s in call_sites(rep)) or any(site in e for e in rep["evidence"]), (
        call_sites(rep), context)
    hang = manifest(run_dir)["hang"]
    # Both ranks found through their traces (no RANK in their environment) and their stacks dumped.
    assert sorted(r["rank"] for r in hang["ranks"]) == [0, 1], hang
    for r in hang["ranks"]:
        assert r["stack_file"] and Path(r["stack_file"]).is_file(), r
    assert survivors(run_dir) == [], "the job's processes outlived moedoctor"
    return rep


# -- torch.multiprocessing.spawn --------------------------------------------------------------------------


def test_mp_spawn_healthy(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, sys.executable, str(LAUNCHERS / "spawn_uneven_shards.py"))
    assert_healthy(run_dir, result)
    assert "done" in result.output
    exits = manifest(run_dir)["ranks"]
    # mp.spawn reaped the ranks: their own statuses are not known, and the manifest says so.
    assert {e["source"] for e in exits.values()} == {"unknown"} and len(exits) == 2


def test_mp_spawn_uneven_shards_is_diagnosed(tmp_path):
    """Rank 0's shard has one batch more: its extra step's DDP all-reduce meets rank 1's epoch barrier."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, sys.executable, str(LAUNCHERS / "spawn_uneven_shards.py"), "--uneven",
                           "--pg-timeout", "120")
    rep = assert_diagnosed(run_dir, result, "desync", [1], "spawn_uneven_shards.py:56")
    assert any(s.endswith("spawn_uneven_shards.py:53") for s in call_sites(rep))  # rank 0's extra backward


# -- accelerate launch ---------------------------------------------------------------------------------

ACCELERATE = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]  # --multi_gpu: torchrun's path, Gloo on CPU


def accelerate_command(*args: str) -> list[str]:
    return [*ACCELERATE, "--main_process_port", str(free_port()), str(LAUNCHERS / "accelerate_rank0_eval.py"), *args]


def test_accelerate_launch_healthy(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, *accelerate_command())
    assert_healthy(run_dir, result)
    assert "eval loss" in result.output and "done" in result.output


def test_accelerate_rank0_only_gather_is_diagnosed(tmp_path):
    """``accelerator.gather`` under ``if accelerator.is_main_process``: rank 0 all-gathers, rank 1 waits
    in ``wait_for_everyone``."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, *accelerate_command("--fault", "--pg-timeout", "120"))
    rep = assert_diagnosed(run_dir, result, "desync", [0], "accelerate_rank0_eval.py:52")
    assert rep["pattern"] == "rank-conditional-collective", rep["summary"]
    assert {op["op"] for op in rep["divergence"]["per_rank"].values()} == {"all_gather", "barrier"}


# -- Lightning's Trainer and its own launcher ------------------------------------------------------------


def test_lightning_ddp_healthy(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, sys.executable, str(LAUNCHERS / "lightning_callback.py"))
    assert_healthy(run_dir, result)
    exits = manifest(run_dir)["ranks"]
    # Lightning's launcher runs rank 0 in the command's own process: its status is the root's.
    assert exits["0"]["source"] == "root" and exits["0"]["exit_code"] == 0, exits
    assert exits["1"]["source"] == "unknown", exits


def test_lightning_callback_rank_zero_all_reduce_is_diagnosed(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, sys.executable, str(LAUNCHERS / "lightning_callback.py"), "--fault",
                           "--pg-timeout", "120")
    rep = assert_diagnosed(run_dir, result, "desync", [0], "lightning_callback.py:49")
    assert rep["pattern"] == "rank-conditional-collective", rep["summary"]
    assert any("lightning_callback.py:48" in e for e in rep["evidence"]), rep["evidence"]  # is_global_zero


# -- Ray: a local cluster started by the driver, actor trainers --------------------------------------------


def test_ray_actor_trainer_healthy(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, sys.executable, str(LAUNCHERS / "ray_actor_trainer.py"), timeout=240,
                           hang_timeout="60")
    assert_healthy(run_dir, result)
    assert "driver: done" in result.output


def test_ray_actor_skipping_a_non_finite_micro_batch_is_diagnosed(tmp_path):
    """The actors set RANK in os.environ at run time (invisible in /proc): found through their traces,
    their stacks dumped, and every process of the cluster (raylet, GCS, workers: they carry the run's
    environment) stopped."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, sys.executable, str(LAUNCHERS / "ray_actor_trainer.py"), "--fault",
                           "--pg-timeout", "150", timeout=240, hang_timeout="60")
    rep = assert_diagnosed(run_dir, result, "desync", [1], "ray_actor_trainer.py:73")
    assert rep["pattern"] == "microbatch-count-mismatch", rep["summary"]
    assert any(s.endswith("ray_actor_trainer.py:72") for s in call_sites(rep))  # rank 0's backward
    pids = {r["rank"]: r["pid"] for r in manifest(run_dir)["hang"]["ranks"]}
    assert f"actors started, pids [{pids[0]}, {pids[1]}]" in result.output  # the actors' own pids


def test_triage_of_a_stuck_ray_job_started_without_moedoctor(tmp_path):
    """No RANK in any process's environment (the actors set it at run time), the actors not children
    of the pid given: triage finds both ranks through their rendezvous store, names their call sites
    and the culprit, and leaves the job running."""
    import re
    import subprocess
    import time

    from moedoctor.runner import procs

    log = tmp_path / "job.log"
    job = subprocess.Popen([sys.executable, str(LAUNCHERS / "ray_actor_trainer.py"), "--fault", "--pg-timeout", "600"],
                           stdout=open(log, "w"), stderr=subprocess.STDOUT, env=job_env(), cwd=tmp_path,
                           start_new_session=True)
    try:
        deadline, doc, actors = time.monotonic() + 150, {}, None
        while time.monotonic() < deadline:
            time.sleep(4)
            assert job.poll() is None, log.read_text()[-3000:]
            found = re.search(r"actors started, pids \[(\d+), (\d+)\]", log.read_text())
            if found is None:
                continue
            actors = {"0": int(found.group(1)), "1": int(found.group(2))}
            done = subprocess.run([sys.executable, "-m", "moedoctor", "triage", "--pid", str(actors["1"]), "--out",
                                   str(tmp_path / f"triage-{time.monotonic():.0f}"), "--json"],
                                  capture_output=True, text=True, timeout=90, cwd=REPO)
            assert done.returncode in (0, 1), done.stderr
            doc = json.loads(done.stdout)
            if doc["verdict"] == "desync" and "ray_actor_trainer.py:73" in doc["summary"]:
                break
        else:
            pytest.fail(f"not stuck as expected; last triage: {doc.get('summary')}\n{log.read_text()[-3000:]}")
        assert {r: v["pid"] for r, v in doc["triage"]["ranks"].items()} == actors
        assert any("rendezvous store" in n and "the other is rank 1" in n for n in doc["triage"]["notes"])
        # Both ranks' call sites, and the culprit: rank 1 is past the micro-batch loop (it skipped its
        # last backward) while rank 0 waits inside it (the stacks and the job's source).
        assert "rank 0 in all_gather_single" in doc["summary"] and "ray_actor_trainer.py:72" in doc["summary"]
        assert "rank 1 in" in doc["summary"]
        assert doc["culprit_ranks"] == [1], (doc["culprit_reasoning"], doc["evidence"])
        assert "past the loop of ray_actor_trainer.py:66" in doc["culprit_reasoning"], doc["culprit_reasoning"]
        time.sleep(1)
        assert job.poll() is None and all(procs.is_alive(pid) for pid in actors.values())  # left running
    finally:
        procs.stop_processes(lambda: procs.job_processes(job.pid), grace=2)  # the cluster is the driver's
        job.wait(timeout=10)


def test_ray_job_on_an_existing_cluster_records_through_runtime_env(tmp_path):
    """A cluster started beforehand (``ray start --head``, without moedoctor): its raylet starts the
    workers, which inherit nothing from the driver. The driver's one line
    (``runtime_env=ray_runtime_env()``) records them: diagnosed, the actors stopped with the job, the
    cluster itself left running."""
    import subprocess
    import time

    from moedoctor.runner import procs

    port = free_port()
    env = job_env(RAY_AUTH_MODE="disabled")
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard", "false", "--disable-usage-stats"],
                            stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "--block" not in (tmp_path / "head.log").read_text() and time.monotonic() < deadline:
            assert head.poll() is None, (tmp_path / "head.log").read_text()
            time.sleep(1)
        run_dir = tmp_path / "run"
        cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "60", "--",
               sys.executable, str(LAUNCHERS / "ray_actor_trainer.py"), "--address", f"127.0.0.1:{port}", "--fault",
               "--pg-timeout", "150"]
        result = run_command(cmd, 240, env=env, cwd=tmp_path)
        rep = assert_diagnosed(run_dir, result, "desync", [1], "ray_actor_trainer.py:73")
        assert rep["pattern"] == "microbatch-count-mismatch", rep["summary"]
        actors = [r["pid"] for r in manifest(run_dir)["hang"]["ranks"]]
        assert not any(procs.is_alive(pid) for pid in actors), actors
        assert head.poll() is None  # the user's cluster is not the job's: left running
    finally:
        procs.stop_processes(lambda: procs.job_processes(head.pid), grace=5)
        head.wait(timeout=10)
        current = Path("/tmp/ray/ray_current_cluster")  # left by a head stopped by a signal: a later
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):  # ray.init() would use it
            current.unlink()


def test_ray_job_on_a_two_node_cluster_is_recorded_diagnosed_and_stopped(tmp_path):
    """Two Ray nodes on one host (``ray start --head`` and ``ray start --address``), one actor on each
    (custom resources): both ranks recorded through ``ray_runtime_env()``, the fault diagnosed, both
    actors stopped with the job, both nodes left running."""
    import subprocess
    import time

    from moedoctor.runner import procs

    port = free_port()
    env = job_env(RAY_AUTH_MODE="disabled")
    common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
    head_cmd = ["ray", "start", "--head", "--port", str(port), "--include-dashboard", "false",
                "--resources", '{"node0": 1}', *common]
    worker_cmd = ["ray", "start", "--address", f"127.0.0.1:{port}", "--resources", '{"node1": 1}', *common]
    nodes: list[subprocess.Popen] = []
    try:
        for i, cmd in enumerate((head_cmd, worker_cmd)):
            log = tmp_path / f"node{i}.log"
            nodes.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                          start_new_session=True))
            deadline = time.monotonic() + 120
            while "--block" not in log.read_text() and time.monotonic() < deadline:
                assert nodes[-1].poll() is None, log.read_text()
                time.sleep(1)
        run_dir = tmp_path / "run"
        cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "60", "--",
               sys.executable, str(LAUNCHERS / "ray_actor_trainer.py"), "--address", f"127.0.0.1:{port}", "--spread",
               "--fault", "--pg-timeout", "150"]
        result = run_command(cmd, 240, env=env, cwd=tmp_path)
        assert "driver: actors on 2 node(s)" in result.output, result.tail()
        rep = assert_diagnosed(run_dir, result, "desync", [1], "ray_actor_trainer.py:73")
        assert rep["pattern"] == "microbatch-count-mismatch", rep["summary"]
        actors = [r["pid"] for r in manifest(run_dir)["hang"]["ranks"]]
        assert not any(procs.is_alive(pid) for pid in actors), actors
        assert all(node.poll() is None for node in nodes)  # the cluster is the user's: left running
    finally:
        for node in reversed(nodes):
            procs.stop_processes(lambda node=node: procs.job_processes(node.pid), grace=5)
            node.wait(timeout=10)
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
