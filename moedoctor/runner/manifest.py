"""``manifest.json``: what was run, where, how it ended, the hang (if any) and the coverage check.

Each node of a run (each ``moedoctor run`` against one shared run directory) owns one entry under
``nodes``; the top-level fields are recomputed from all entries every time a node writes, under an
``fcntl`` lock on ``manifest.json.lock``, and the file is replaced atomically.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moedoctor import environment
from moedoctor._files import NO_SPACE, rewrite_in_place, write_atomically
from moedoctor.run_records import (  # noqa: F401 - the records live below the runner; re-exported here
    HangRecord,
    LastCollective,
    RankAtHang,
    RankExit,
    BusyRecord,
)
from moedoctor.manifest_format import (  # noqa: F401 - the format and its reader are a shared leaf; re-exported here
    FORMAT as MANIFEST_FORMAT,
    VERSION as MANIFEST_VERSION,
    HangKey,
    Key,
    Manifest,
    NodeKey,
    Status,
    hang_of,
    load_manifest,
)
from moedoctor.runner.progress import RankProgress

_ENV_KEYS = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "OMP_NUM_THREADS",
        "PYTHONPATH",
        "LD_LIBRARY_PATH",
        "SLURM_JOB_ID",
        "SLURM_NODEID",
        "SLURM_PROCID",
    }
)
_ENV_PREFIXES = ("NCCL_", "TORCH_", "TORCHELASTIC_", "PYTORCH_", "GLOO_", environment.PREFIX, "NVIDIA_", "UCX_", "FI_")


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that changes how a distributed job communicates."""
    return {k: v for k, v in sorted(env.items()) if k in _ENV_KEYS or k.startswith(_ENV_PREFIXES)}


@dataclass
class CoverageCheck:
    """Recorded collectives against each group's backend counter, from the ranks' last coverage
    records; ``gaps`` lists every disagreement and every rank that could not be checked."""

    complete: bool
    gaps: list[dict] = field(default_factory=list)


@dataclass
class NodeRecord:
    node: str
    host: str
    moedoctor_pid: int
    start: float
    end: float | None = None
    status: str = Status.RUNNING
    launcher_exit: int | None = None
    log: str | None = None  # this node's copy of the job's output
    env: dict[str, str] = field(default_factory=dict)
    ranks: list[RankExit] = field(default_factory=list)
    hang: HangRecord | None = None
    lags: list[str] = field(default_factory=list)  # online lag findings, one line each (at most 100)
    #: Silences of the collectives that were not hangs (busy, or unproven), at most 100.
    busy: list[BusyRecord] = field(default_factory=list)
    #: Ranks whose recorder stopped on a failed write (``rank 1 stopped recording: ...``), and
    #: moedoctor's own writes that failed (``cannot write stacks/rank-0.json: ...``), one line each.
    recording_stopped: list[str] = field(default_factory=list)
    write_errors: list[str] = field(default_factory=list)


def coverage_check(ranks: Mapping[int, RankProgress], world_size: int | None) -> CoverageCheck:
    gaps: list[dict] = []
    expected = range(world_size) if world_size else sorted(ranks)
    for rank in expected:
        state = ranks.get(rank)
        if state is None:
            gaps.append({"rank": rank, "problem": "no trace"})
            continue
        cov = state.coverage
        if cov is None:
            gaps.append({"rank": rank, "problem": "no coverage record (the rank never reported its counters)"})
            continue
        if cov.dropped:
            gaps.append({"rank": rank, "problem": f"{cov.dropped} events dropped at the trace cap"})
        for g in cov.groups:
            if g.gap not in (0, None):
                gaps.append(
                    {"rank": rank, "group": g.group, "recorded": g.recorded, "backend": g.backend, "gap": g.gap}
                )
    return CoverageCheck(complete=not gaps, gaps=gaps)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)  # POSIX record locks also hold across NFS clients
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)


def write_node(
    path: Path,
    node: NodeRecord,
    *,
    command: list[str],
    versions: Mapping[str, object],
    world_size: int | None = None,
    hosts: Sequence[str] = (),
    coverage: CoverageCheck | None = None,
    trace_problems: Sequence[str] = (),
) -> dict:
    """Merge this node's entry into the manifest at ``path``; return the whole manifest."""
    with _locked(path):
        doc = Manifest.read_or_empty(path).doc
        if doc.get(Key.FORMAT) != MANIFEST_FORMAT:
            doc = {
                Key.FORMAT: MANIFEST_FORMAT,
                Key.VERSION: MANIFEST_VERSION,
                Key.COMMAND: command,
                **versions,
                Key.ENV: node.env,
                Key.NODES: {},
            }
        doc[Key.NODES][node.node] = asdict(node)
        nodes = list(doc[Key.NODES].values())
        doc[Key.WORLD_SIZE] = world_size or doc.get(Key.WORLD_SIZE)
        doc[Key.HOSTS] = sorted({n[NodeKey.HOST] for n in nodes} | set(doc.get(Key.HOSTS, ())) | set(hosts))
        doc[Key.START] = min(n[NodeKey.START] for n in nodes)
        doc[Key.END] = None if any(n[NodeKey.END] is None for n in nodes) else max(n[NodeKey.END] for n in nodes)
        doc[Key.STATUS] = _overall_status([n[NodeKey.STATUS] for n in nodes])
        doc[Key.RANKS] = _merge_ranks(nodes)
        doc[Key.HANG] = _merge_hangs([n[NodeKey.HANG] for n in nodes if n[NodeKey.HANG]])
        busy = (b for n in nodes for b in n.get(NodeKey.BUSY) or ())
        doc[Key.BUSY] = sorted(busy, key=lambda b: b["start"])[:100]
        if coverage is not None:
            doc[Key.COVERAGE] = asdict(coverage)
        doc.setdefault(Key.COVERAGE, None)
        if trace_problems:
            doc[Key.TRACE_PROBLEMS] = list(trace_problems)
        text = json.dumps(doc, indent=1)
        try:
            write_atomically(path, text)
        except OSError as e:
            # Disk full: the manifest's own blocks may still hold it (a run's last word, its exits).
            if e.errno not in NO_SPACE or not path.exists() or not rewrite_in_place(path, text.encode()):
                raise
        return doc


_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK_LINE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:", re.MULTILINE)


def root_cause_rank(log: str) -> int | None:
    """The rank torchrun's failure report names as the root cause ("first observed failure": it
    had failed when the launcher looked, before it stopped the other ranks), from the job's output;
    None without such a report."""
    at = log.rfind(_ROOT_CAUSE)
    if at < 0:
        return None
    m = _RANK_LINE.search(log, at, at + 2000)
    return int(m.group(1)) if m else None


def read_nodes(path: Path) -> dict[str, dict]:
    """The ``nodes`` of the manifest at ``path`` (empty when it cannot be read: not written yet)."""
    return Manifest.read_or_empty(Path(path)).nodes


def _overall_status(statuses: list[str]) -> str:
    for status in (Status.RUNNING, Status.HANG, Status.INTERRUPTED):
        if status in statuses:
            return status
    return Status.FINISHED


def _merge_ranks(nodes: list[dict]) -> dict[str, dict]:
    merged: dict[int, dict] = {}
    for node in nodes:
        for entry in node[NodeKey.RANKS]:
            # A node knows the exit of its own ranks best; other entries only fill gaps.
            current = merged.get(entry["rank"])
            if current is None or (current["exit_code"] is None and entry["exit_code"] is not None):
                merged[entry["rank"]] = entry
    return {str(rank): merged[rank] for rank in sorted(merged)}


def _merge_hangs(hangs: list[dict]) -> dict | None:
    """The first node's hang, with each rank's entry taken from the node that dumped its stack."""
    if not hangs:
        return None
    hangs = sorted(hangs, key=lambda h: h[HangKey.DETECTED_AT])
    merged = dict(hangs[0])
    by_rank: dict[int, dict] = {}
    for hang in hangs:
        for entry in hang[HangKey.RANKS]:
            rank = entry[HangKey.RANK]
            if rank not in by_rank or (entry[HangKey.STACK_FILE] and not by_rank[rank][HangKey.STACK_FILE]):
                by_rank[rank] = entry
    merged[HangKey.RANKS] = [by_rank[r] for r in sorted(by_rank)]
    merged[HangKey.GPU_FILES] = sorted({h[HangKey.GPU_FILE] for h in hangs if h.get(HangKey.GPU_FILE)})
    return merged
