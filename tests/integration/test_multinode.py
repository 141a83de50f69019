"""Multi-node for real: two torchrun agents on this host as two "nodes" (``--nnodes 2``, c10d
rendezvous, one process each), each under its own ``moedoctor run``, on a fixture that deadlocks
across the nodes (inflight_metric_allreduce: rank 1 issues its metric all_reduce where rank 0 issues
an FSDP all_gather). With one shared run directory, and with a run directory per node (the
supervisors then exchange what detection needs through the job's own rendezvous store)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_util import FIXTURES, REPO, _kill_session, job_env, live_processes

FIXTURE = FIXTURES / "inflight_metric_allreduce" / "train.py"
PATTERN, CULPRIT = "inflight-metric-allreduce", [1]
TIMEOUT = 150.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_command(run_dir: Path, node: int, port: int, rdzv_id: str, *extra: str, fixture: Path = FIXTURE,
                  nproc: int = 1, backend: str = "gloo") -> list[str]:
    return [
        sys.executable, "-m", "moedoctor", "run", "--run-dir", str(run_dir), "--hang-timeout", "20", *extra, "--",
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
        "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", rdzv_id, str(fixture), "--pg-timeout", "40", "--backend", backend,
    ]


def _job_processes(run_dirs: list[Path]) -> list[int]:
    """Live processes of the job: any process whose environment names one of the run directories."""
    wanted = {f"MOEDOCTOR_RUN_DIR={Path(d).resolve()}".encode() for d in run_dirs}

    def matches(proc: Path) -> bool:
        try:
            return bool(wanted & set((proc / "environ").read_bytes().split(b"\0")))
        except OSError:
            return False

    return live_processes(matches)


def run_two_nodes(run_dirs: list[Path], *extra: str, fixture: Path = FIXTURE, nproc: int = 1,
                  timeout: float = TIMEOUT, backend: str = "gloo") -> list[tuple[int, str, float]]:
    """Both nodes' ``moedoctor run`` started at once; (exit code, output, seconds) per node. Every
    process is killed in the end, whatever happens. NCCL: node N on GPU N (two single-GPU nodes)."""
    port, rdzv_id = _free_port(), f"mn{os.getpid()}"
    procs, logs = [], []
    start = time.monotonic()
    try:
        for node, run_dir in enumerate(run_dirs):
            log = open(run_dir.parent / f"node{node}.out", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    _node_command(run_dir, node, port, rdzv_id, *extra, fixture=fixture, nproc=nproc,
                                  backend=backend), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                    env=job_env(**({"CUDA_VISIBLE_DEVICES": str(node)} if backend == "nccl" else {})),
                    start_new_session=True,
                )
            )
        results = []
        for proc, log in zip(procs, logs):
            try:
                code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                code = -9
            log.seek(0)
            results.append((code, log.read(), time.monotonic() - start))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_session(proc.pid)
                proc.wait()
        for log in logs:
            log.close()


def _tails(results) -> str:
    return "\n".join(f"--- node {n} (exit {c}, {s:.0f} s)\n" + "\n".join(out.splitlines()[-40:])
                     for n, (c, out, s) in enumerate(results))


def _assert_stopped_everywhere(run_dirs: list[Path], results) -> None:
    deadline = time.monotonic() + 10
    while _job_processes(run_dirs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _job_processes(run_dirs), f"processes left running: {_job_processes(run_dirs)}\n{_tails(results)}"


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def test_two_nodes_one_shared_run_dir(tmp_path, backend="gloo"):
    run_dir = tmp_path / "run"
    results = run_two_nodes([run_dir, run_dir], backend=backend)
    try:
        assert [c for c, _, _ in results] == [124, 124], _tails(results)
        report = _report(run_dir)
        assert report["pattern"] == PATTERN and report["culprit_ranks"] == CULPRIT, _tails(results)
        manifest = json.loads((run_dir / "manifest.json").read_text())
        nodes = list(manifest["nodes"].values())
        assert len(nodes) == 2 and all(n["status"] == "hang" and n["hang"] for n in nodes), manifest["nodes"]
        # Each node dumped its own rank; the merged hang names both stacks.
        assert sorted(p.name for p in (run_dir / "stacks").glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
        assert all(r["stack_file"] for r in manifest["hang"]["ranks"]), manifest["hang"]
        # One log per node: the first node's job.log, the other's beside it.
        assert len({n["log"] for n in nodes}) == 2
    finally:
        _assert_stopped_everywhere([run_dir], results)


def test_two_nodes_one_run_dir_each(tmp_path, backend="gloo"):
    """No shared file system: each node sees only its own rank's trace; the desync is found by the
    coordinator through the rendezvous store, and every node stops its own rank. ``analyze DIR1 DIR2``
    then gives the pattern and culprit of the shared-directory run."""
    run_dirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    for d in run_dirs:
        d.parent.mkdir()
    results = run_two_nodes(run_dirs, backend=backend)
    try:
        assert [c for c, _, _ in results] == [124, 124], _tails(results)
        stacks = []
        for d in run_dirs:
            manifest = json.loads((d / "manifest.json").read_text())
            (node,) = manifest["nodes"].values()
            assert node["status"] == "hang" and node["hang"]["trigger"] == "desync", (node["hang"], _tails(results))
            assert "#61" in node["hang"]["finding"], node["hang"]["finding"]
            assert len(list((d / "traces").glob("rank-*.jsonl"))) == 1  # its own rank only
            stacks += [p.name for p in (d / "stacks").glob("rank-*.json")]
        assert sorted(stacks) == ["rank-0.json", "rank-1.json"]
        merged = subprocess.run([sys.executable, "-m", "moedoctor", "analyze", *map(str, run_dirs), "--json"],
                                capture_output=True, text=True, cwd=REPO, timeout=120)
        report = json.loads(merged.stdout)
        assert merged.returncode == 1 and report["pattern"] == PATTERN and report["culprit_ranks"] == CULPRIT, (
            merged.stderr[-2000:])
        assert sorted(report["source"]["traced_ranks"]) == [0, 1]
    finally:
        _assert_stopped_everywhere(run_dirs, results)


def test_a_straggler_across_nodes_without_a_shared_run_dir_is_proven_and_stopped(tmp_path):
    """Busy is not stuck, across nodes: rank 1 (node 1) sleeps in its data loader while rank 0 (node 0)
    waits in the all-reduce. Neither node sees the other's rank; each publishes its own ranks' states
    through the rendezvous store, so the hang is proven and the job stopped on both nodes."""
    run_dirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    for d in run_dirs:
        d.parent.mkdir()
    results = run_two_nodes(run_dirs, "--hang-timeout", "8", fixture=FIXTURES / "straggler" / "train.py")
    try:
        # A node that proves first stops its rank; the other node's rank may then fail in its
        # collective (the job's own exit) before that node's proof: at least one proof, naming both.
        codes = [c for c, _, _ in results]
        assert 124 in codes and all(c != 0 for c in codes), _tails(results)
        for d, code in zip(run_dirs, codes):
            (node,) = json.loads((d / "manifest.json").read_text())["nodes"].values()
            if code != 124:
                continue
            hang = node["hang"]
            assert hang["trigger"] == "hang", (hang, _tails(results))
            assert "rank 0 waits in all_reduce" in hang["proof"], (hang["proof"], _tails(results))
            assert "rank 1 outside any collective in ShardReader._read_shard" in hang["proof"], hang["proof"]
    finally:
        _assert_stopped_everywhere(run_dirs, results)


def test_a_healthy_two_node_job_is_left_alone(tmp_path):
    """Do no harm: the exchange between per-node run directories raises no alarm on a healthy job."""
    run_dirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    for d in run_dirs:
        d.parent.mkdir()
    results = run_two_nodes(run_dirs, fixture=FIXTURES / "healthy" / "train.py")
    try:
        assert [c for c, _, _ in results] == [0, 0], _tails(results)
        for d in run_dirs:
            (node,) = json.loads((d / "manifest.json").read_text())["nodes"].values()
            assert node["status"] == "finished" and node["hang"] is None, _tails(results)
    finally:
        _assert_stopped_everywhere(run_dirs, results)


@pytest.mark.heavy
def test_sixteen_ranks_two_nodes_of_eight_one_run_dir_each(tmp_path):
    """2 nodes x 8 ranks (Gloo, tiny tensors), a run directory per node: the desync of rank 1 against
    the 15 others is found through the store, every node stops its 8 ranks, and the merged analysis
    names the pattern and the culprit. Prints the time it took."""
    run_dirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    for d in run_dirs:
        d.parent.mkdir()
    results = run_two_nodes(run_dirs, "--hang-timeout", "60", nproc=8, timeout=400)
    try:
        print(f"16 ranks: nodes ended after {[round(s) for _, _, s in results]} s")
        assert [c for c, _, _ in results] == [124, 124], _tails(results)
        for d in run_dirs:
            (node,) = json.loads((d / "manifest.json").read_text())["nodes"].values()
            assert node["hang"]["trigger"] == "desync", (node["hang"], _tails(results))
        merged = subprocess.run([sys.executable, "-m", "moedoctor", "analyze", *map(str, run_dirs), "--json"],
                                capture_output=True, text=True, cwd=REPO, timeout=300)
        report = json.loads(merged.stdout)
        assert report["pattern"] == PATTERN and report["culprit_ranks"] == CULPRIT, merged.stderr[-2000:]
        assert sorted(report["source"]["traced_ranks"]) == list(range(16))
    finally:
        _assert_stopped_everywhere(run_dirs, results)


def _two_gpus() -> bool:
    try:
        import torch

        return torch.cuda.device_count() >= 2
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("layout", ["shared", "per-node"])
def test_nccl_two_single_gpu_nodes(tmp_path, layout):
    """The same on NCCL: two single-GPU nodes (node N sees GPU N only)."""
    if layout == "shared":
        test_two_nodes_one_shared_run_dir(tmp_path, backend="nccl")
    else:
        test_two_nodes_one_run_dir_each(tmp_path, backend="nccl")
