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
from torchrun_util import FIXTURES, REPO, JobResult, job_env, live_processes, run_command, torch_exit_abort

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
    command = (sys.executable, str(LAUNCHERS / "spawn_uneven_shards.py"))
    result = moedoctor_run(run_dir, *command)
    if torch_exit_abort(result, run_dir):  # a DDP job on Gloo: PyTorch's own teardown race, retried once
        print(f"a rank aborted at exit (PyTorch teardown race); retrying once\n{result.tail(20)}")
        run_dir = tmp_path / "run-retry"
        result = moedoctor_run(run_dir, *command)
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


def _can_give_a_node_its_own_mounts() -> str | None:
    """Why a Ray node cannot be given a file system view of its own here (None: it can)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return "no unshare(1)"
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"unshare --mount refused: {done.stderr.strip()[:200]}"


class RayCluster:
    """Two Ray nodes on one host, started with ``ray start`` (without moedoctor): the head (custom
    resource ``node0``) and a worker node (``node1``). The worker node runs in a mount namespace of
    its own where ``node_local_run`` is another directory (``node1_run``): a run directory there is
    per node, as on two hosts without a shared file system; every other path is shared."""

    def __init__(self, base: Path):
        self.base = base
        self.port = free_port()
        self.env = job_env(RAY_AUTH_MODE="disabled")
        self.node_local_run = base / "per-node" / "run"
        self.node1_run = base / "per-node" / "run-node1"
        self.own_mounts = _can_give_a_node_its_own_mounts()  # None: the worker node has them
        self.nodes: list = []

    def start(self) -> None:
        import shlex
        import subprocess
        import time

        common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
        head = ["ray", "start", "--head", "--port", str(self.port), "--include-dashboard", "false",
                "--resources", '{"node0": 1}', *common]
        worker = ["ray", "start", "--address", f"127.0.0.1:{self.port}", "--resources", '{"node1": 1}', *common]
        if self.own_mounts is None:
            self.node_local_run.mkdir(parents=True)
            self.node1_run.mkdir()
            worker = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                      f"mount --bind {self.node1_run} {self.node_local_run} && exec {shlex.join(worker)}"]
        for i, cmd in enumerate((head, worker)):
            log = self.base / f"node{i}.log"
            self.nodes.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=self.env,
                                               cwd=self.base, start_new_session=True))
            deadline = time.monotonic() + 120
            while "--block" not in log.read_text() and time.monotonic() < deadline:
                assert self.nodes[-1].poll() is None, log.read_text()
                time.sleep(1)

    def alive(self) -> bool:
        return all(node.poll() is None for node in self.nodes)

    def stop(self) -> None:
        from moedoctor.runner import procs

        for node in reversed(self.nodes):
            procs.stop_processes(lambda node=node: procs.job_processes(node.pid), grace=5)
            node.wait(timeout=10)
        current = Path("/tmp/ray/ray_current_cluster")  # left by a head stopped by a signal: a later
        if current.is_file() and current.read_text().strip().endswith(f":{self.port}"):  # ray.init() would use it
            current.unlink()

    def driver(self, run_dir: Path, *args: str, timeout: float = 240, hang_timeout: str = "60") -> JobResult:
        """``moedoctor run`` on the driver, joined to this cluster with ``ray_runtime_env()``, one actor
        on each node."""
        cmd = [sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", hang_timeout, "--",
               sys.executable, str(LAUNCHERS / "ray_actor_trainer.py"), "--address", f"127.0.0.1:{self.port}",
               "--spread", *args]
        return run_command(cmd, timeout, env=self.env, cwd=self.base)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One cluster for the tests of jobs on an existing cluster, started once."""
    cluster = RayCluster(tmp_path_factory.mktemp("ray-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_ray_job_on_a_two_node_cluster_is_recorded_diagnosed_and_stopped(ray_cluster, tmp_path):
    """A cluster started beforehand (``ray start --head``, ``ray start --address``: two nodes on one
    host, one actor on each through custom resources), without moedoctor: its raylets start the
    workers, which inherit nothing from the driver. The driver's one line
    (``runtime_env=ray_runtime_env()``) records them into the shared run directory: both ranks
    recorded, the fault diagnosed, every process of the job stopped (both actors, on both nodes),
    the cluster left running."""
    from moedoctor.runner import procs

    run_dir = tmp_path / "run"
    result = ray_cluster.driver(run_dir, "--fault", "--pg-timeout", "150")
    assert "driver: actors on 2 node(s)" in result.output, result.tail()
    rep = assert_diagnosed(run_dir, result, "desync", [1], "ray_actor_trainer.py:73")  # and no survivor
    assert rep["pattern"] == "microbatch-count-mismatch", rep["summary"]
    assert any(s.endswith("ray_actor_trainer.py:72") for s in call_sites(rep))  # rank 0's backward
    actors = [r["pid"] for r in manifest(run_dir)["hang"]["ranks"]]
    assert not any(procs.is_alive(pid) for pid in actors), actors
    assert ray_cluster.alive()  # the cluster is the user's: left running


def test_ray_job_with_a_run_directory_per_node_is_merged_by_analyze(ray_cluster):
    """The same job where the nodes share no file system (the worker node sees its own directory at
    the run directory's path): each node's directory holds its own rank's trace. The driver's
    moedoctor sees rank 0 only, so it cannot prove a hang (it says so) and the job ends at its own
    process-group timeout, with nothing of it left running; ``moedoctor analyze DIR1 DIR2`` on the
    gathered directories gives the diagnosis: the culprit and both call sites."""
    if ray_cluster.own_mounts is not None:
        pytest.skip(f"no node-local directory can be made here: {ray_cluster.own_mounts}")
    import subprocess

    run_dir, node1_run = ray_cluster.node_local_run, ray_cluster.node1_run
    result = ray_cluster.driver(run_dir, "--fault", "--pg-timeout", "45", hang_timeout="15")
    assert "driver: actors on 2 node(s)" in result.output, result.tail()
    assert result.returncode == 1, result.tail()  # the job's own failure (Gloo's timeout), not stopped
    m = manifest(run_dir)
    assert m["hang"] is None, m["hang"]  # no hang declared without proof
    unproven = [b["line"] for b in m["busy"] if b["kind"] == "unproven"]
    assert any("rank 1: no evidence" in line for line in unproven), (m["busy"], result.tail())
    assert [p.name for p in (run_dir / "traces").glob("rank-*.jsonl")] == ["rank-00000.jsonl"]
    assert [p.name for p in (node1_run / "traces").glob("rank-*.jsonl")] == ["rank-00001.jsonl"]
    assert survivors(run_dir) == [], "the job's processes outlived it"
    assert ray_cluster.alive()

    merged = subprocess.run([sys.executable, "-m", "moedoctor", "analyze", str(run_dir), str(node1_run), "--json"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    rep = json.loads(merged.stdout)
    context = (rep["summary"], rep["evidence"], merged.stderr[-2000:])
    assert rep["verdict"] == "desync" and rep["pattern"] == "microbatch-count-mismatch", context
    assert rep["culprit_ranks"] == [1], context
    sites = call_sites(rep)
    assert any(s.endswith("ray_actor_trainer.py:72") for s in sites), sites
    assert any(s.endswith("ray_actor_trainer.py:73") for s in sites), sites
    # Neither directory alone tells: each lacks the other rank's trace.
    alone = subprocess.run([sys.executable, "-m", "moedoctor", "analyze", str(run_dir), "--json"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "no readable trace of rank 1" in alone.stdout + alone.stderr, (alone.stdout[-1500:], alone.stderr[-1500:])
