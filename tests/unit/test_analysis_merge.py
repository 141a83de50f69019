"""``load_runs``: one job recorded in one run directory per node (no shared file system) is analyzed
as one run, with the same answer as the same job recorded in one shared directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moedoctor.analysis import analyze, load_run, load_runs
from moedoctor.render.json_report import report_to_dict

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "inflight_metric_allreduce"


def split_by_node(tmp_path: Path) -> list[Path]:
    """The golden two-rank run as two nodes' run directories, one rank each."""
    whole = json.loads((GOLDEN / "manifest.json").read_text())
    dirs = []
    for rank in (0, 1):
        d = tmp_path / f"node{rank}"
        for sub in ("traces", "stacks", "gpu"):
            (d / sub).mkdir(parents=True)
        shutil.copy(GOLDEN / "traces" / f"rank-{rank:05d}.jsonl", d / "traces")
        shutil.copy(GOLDEN / "stacks" / f"rank-{rank}.json", d / "stacks")
        shutil.copy(GOLDEN / "gpu" / "vm.json", d / "gpu")
        manifest = json.loads(json.dumps(whole))
        manifest["hang"]["ranks"] = [r for r in manifest["hang"]["ranks"] if r["rank"] == rank]
        manifest["ranks"] = {k: v for k, v in manifest["ranks"].items() if int(k) == rank}
        (d / "manifest.json").write_text(json.dumps(manifest))
        dirs.append(d)
    return dirs


def essentials(report) -> dict:
    doc = report_to_dict(report)
    return {k: doc[k] for k in ("verdict", "pattern", "culprit_ranks", "divergence", "fixes", "evidence")}


def test_per_node_run_dirs_merge_into_the_shared_dirs_analysis(tmp_path):
    dirs = split_by_node(tmp_path)
    merged = load_runs(dirs)
    assert merged.ranks == [0, 1] and sorted(merged.stacks) == [0, 1] and merged.world_size == 2
    assert [r.rank for r in merged.manifest.hang.ranks] == [0, 1]
    assert all(r.stack_file for r in merged.manifest.hang.ranks)
    assert not any("no trace of rank" in line for line in merged.incomplete), merged.incomplete
    assert essentials(analyze(merged)) == essentials(analyze(load_run(GOLDEN)))
    assert analyze(merged).pattern == "inflight-metric-allreduce"


def test_one_node_alone_says_what_is_missing(tmp_path):
    alone = load_run(split_by_node(tmp_path)[0])
    assert any("no trace of rank 1" in line for line in alone.incomplete)


def test_the_same_directory_twice_keeps_each_rank_once(tmp_path):
    run = load_runs([GOLDEN, GOLDEN])
    assert run.ranks == [0, 1]
    assert any("already read" in line for line in run.incomplete)
