"""The manifest: nodes merged under a lock, the hang read back as typed records."""

from __future__ import annotations

import json

from moedoctor.runner.manifest import (
    CoverageCheck, HangRecord, LastCollective, NodeRecord, RankAtHang, RankExit, Status, hang_of,
    relevant_env, write_node,
)

VERSIONS = {"moedoctor_version": "0.1.0", "torch_version": "2.13.0"}
COMMAND = ["torchrun", "--nnodes=2", "train.py"]


def node(name: str, host: str, start: float, ranks: list[int], **extra) -> NodeRecord:
    return NodeRecord(node=name, host=host, moedoctor_pid=1, start=start,
                      ranks=[RankExit(r, host, 100 + r, r % 2, None, "unknown") for r in ranks], **extra)


def test_nodes_merge_into_one_manifest(tmp_path):
    path = tmp_path / "manifest.json"
    a = node("a:1", "a", 10.0, [0, 1])
    write_node(path, a, command=COMMAND, versions=VERSIONS, world_size=4)
    b = node("b:1", "b", 11.0, [2, 3])
    doc = write_node(path, b, command=COMMAND, versions=VERSIONS)
    assert doc["status"] == Status.RUNNING and doc["hosts"] == ["a", "b"] and doc["world_size"] == 4
    assert sorted(doc["ranks"]) == ["0", "1", "2", "3"] and doc["start"] == 10.0 and doc["end"] is None

    a.status, a.end = Status.FINISHED, 20.0
    write_node(path, a, command=COMMAND, versions=VERSIONS)
    b.status, b.end = Status.FINISHED, 21.0
    doc = write_node(path, b, command=COMMAND, versions=VERSIONS, coverage=CoverageCheck(True))
    assert doc["status"] == Status.FINISHED and doc["end"] == 21.0
    assert json.loads(path.read_text())["coverage"] == {"complete": True, "gaps": []}


def test_hang_is_merged_across_nodes_and_read_back(tmp_path):
    path = tmp_path / "manifest.json"
    last = LastCollective("0", 7, "all_reduce", "train.py:10 step", "backward", 3, False)
    for name, host, at, mine in (("a:1", "a", 50.0, 0), ("b:1", "b", 50.5, 1)):
        ranks = [RankAtHang(r, "a" if r == 0 else "b", 100 + r, last, 3.0,
                            stack_file=f"stacks/rank-{r}.json" if r == mine else None) for r in (0, 1)]
        hang = HangRecord(detected_at=at, host=host, hang_timeout=3.0, idle_seconds=3.1, stopped=True,
                          ranks=ranks, gpu_file=f"gpu/{host}.json")
        doc = write_node(path, node(name, host, 1.0, [mine], status=Status.HANG, hang=hang),
                         command=COMMAND, versions=VERSIONS)
    assert doc["status"] == Status.HANG and doc["hang"]["host"] == "a"
    assert doc["hang"]["gpu_files"] == ["gpu/a.json", "gpu/b.json"]
    read = hang_of(doc)
    assert [r.stack_file for r in read.ranks] == ["stacks/rank-0.json", "stacks/rank-1.json"]
    assert read.ranks[0].last == last


def test_relevant_env_keeps_what_changes_communication():
    env = {"NCCL_DEBUG": "INFO", "MASTER_ADDR": "n0", "HOME": "/root", "TORCH_NCCL_BLOCKING_WAIT": "1",
           "AWS_SECRET_ACCESS_KEY": "x", "OMP_NUM_THREADS": "1"}
    assert relevant_env(env) == {"MASTER_ADDR": "n0", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1",
                                 "TORCH_NCCL_BLOCKING_WAIT": "1"}
