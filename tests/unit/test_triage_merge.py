"""``merge_triages``: the triage folders of a multi-node job's nodes (each node's ``moedoctor triage
--pid``) give one report, as the whole job's folder would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_analysis_merge import GOLDEN, split_by_node

from moedoctor.analysis.model import Verdict
from moedoctor.errors import MoedoctorError
from moedoctor.triage import merge_triages


def triage_folders(tmp_path: Path, traces: bool) -> list[Path]:
    """Each node's triage folder: its rank's stack, GPU snapshot, triage.json, and (a job under
    moedoctor run) its traces and manifest."""
    dirs = split_by_node(tmp_path)
    for rank, d in enumerate(dirs):
        (d / "triage.json").write_text(json.dumps({"ranks": {str(rank): {"state": "S"}}, "world_size": 2}))
        if not traces:
            shutil.rmtree(d / "traces")
            (d / "manifest.json").unlink()
    return dirs


def test_nodes_triages_with_traces_merge_into_the_jobs_report(tmp_path):
    report, evidence, notes = merge_triages(triage_folders(tmp_path, traces=True))
    assert evidence == "traces", notes
    assert report.pattern == "inflight-metric-allreduce" and report.culprit_ranks == [1]
    assert report.traced_ranks == [0, 1]


def test_nodes_stacks_alone_merge(tmp_path):
    report, evidence, notes = merge_triages(triage_folders(tmp_path, traces=False))
    alone, _, _ = merge_triages(triage_folders(tmp_path / "alone", traces=False)[:1])
    assert evidence == "stacks"
    # Both nodes' ranks: the two wait in different collectives, a code desync. One node alone sees a
    # rank stuck in a collective, and can only suspect the hardware or a peer on another node.
    assert report.verdict == Verdict.DESYNC and {r.rank for r in report.ranks} == {0, 1}, report.summary
    assert alone.verdict == Verdict.STUCK and any("no stack of rank 1" in line for line in alone.incomplete)


def test_not_triage_folders_are_refused(tmp_path):
    with pytest.raises(MoedoctorError, match="no rank's stack"):
        merge_triages([tmp_path])
    assert GOLDEN.is_dir()
