"""``load_run(path) -> RunData``: everything the analysis reads, parsed at the boundary.

PATH is a run directory (``manifest.json``, ``traces/``, ``stacks/``, ``gpu/``), a folder of
moedoctor traces (``rank-*.jsonl``), one trace file, or a folder of PyTorch Flight Recorder dumps.
Damaged input never raises: a truncated or corrupt record, an unreadable or foreign file, a missing
rank, a stack dump or manifest that does not parse, each becomes a line of ``RunData.incomplete``
and the analysis goes on with what is left. Only a path that holds nothing to analyze at all raises
``MoedoctorError`` (exit status 2).

Traces larger than ``stream_above`` bytes in all are not loaded whole: ``moedoctor.analysis.loading.scan``
hashes each rank's collectives per group in one streaming pass, finds where the ranks first differ,
and loads only those windows and each file's tail (``RunData.windowed``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from moedoctor.analysis.loading.completion import fuse_flight_recorder
from moedoctor.analysis.loading.run_data import GpuDevice, GpuSnapshot, ManifestInfo, RunData, SourceKind
from moedoctor.analysis.loading.scan import load_windowed
from moedoctor.analysis.model import Verdict
from moedoctor.errors import EXIT_USAGE, MoedoctorError
from moedoctor.layout import GPU, JOB_LOG, JOB_LOGS, MANIFEST, STACK_FILES, STACKS, TRACES, RunDir
from moedoctor.manifest_format import Manifest
from moedoctor.run_records import RankExit, StackDump, read_stack_dump, supervisor_alive
from moedoctor.trace.format import STOPPED, read_statuses, recorder_markers, stopped_line
from moedoctor.trace.reader import RankTrace, bounded_int, trace_paths
from moedoctor.trace.schema import MAX_WORLD_SIZE
from moedoctor.analysis.loading.trace_files import _clip, _int, last_sequences, read_rank_trace
from moedoctor.wording import rank_ranges

#: Above this many bytes of trace files the streaming path is used (see ``moedoctor.analysis.loading.scan``).
STREAM_THRESHOLD = 64 << 20


#: Arguments of the recorded launch command kept (bounded analysis).
MAX_COMMAND_ARGS = 4096


def load_runs(
    paths: Sequence[Path | str], *, stream_above: int = STREAM_THRESHOLD, workers: int | None = None
) -> RunData:
    """Read one job recorded in several places, as one run: the run directories of its nodes (each
    node's ``moedoctor run`` with its own ``--run-dir``, no shared file system), or folders of
    traces. Traces, stacks, GPU snapshots and the manifests' exits and hang records are merged (a
    rank read twice is kept once, and said); the world size is checked on the merged whole."""
    if len(paths) == 1:
        return load_run(paths[0], stream_above=stream_above, workers=workers)
    parts = [load_run(p, stream_above=stream_above, workers=workers, note_world=False) for p in paths]
    run = parts[0]
    for part in parts[1:]:
        run.traces += part.traces
        run.incomplete += part.incomplete
        run.gpus += part.gpus
        for rank, dump in part.stacks.items():
            run.stacks.setdefault(rank, dump)
        run.windowed = run.windowed or part.windowed
        run.open_ended |= part.open_ended
        run.recording_stopped.update(part.recording_stopped)
        run.last_seq = {**part.last_seq, **run.last_seq}
        run.last_p2p = {**part.last_p2p, **run.last_p2p}
        run.manifest = _merge_manifests(run.manifest, part.manifest)
        if part.kind == SourceKind.RUN_DIR:
            run.kind = SourceKind.RUN_DIR
    _dedupe_and_sort(run)
    _note_world(run, note_other_ranks=True)
    return run


def _merge_manifests(a: ManifestInfo | None, b: ManifestInfo | None) -> ManifestInfo | None:
    """Two nodes' manifests as one: exits of both, the earlier hang with each rank's entry from the
    node that dumped its stack, the largest world size; a node still running keeps it running."""
    if a is None or b is None:
        return a or b
    order = ("running", "hang", "interrupted", "finished")
    statuses = [s for s in (a.status, b.status) if s is not None]
    status = min(statuses, key=lambda s: order.index(s) if s in order else len(order)) if statuses else None
    hang = a.hang or b.hang
    if a.hang is not None and b.hang is not None:
        first, second = sorted((a.hang, b.hang), key=lambda h: h.detected_at)
        by_rank = {r.rank: r for r in second.ranks}
        for r in first.ranks:
            if r.rank not in by_rank or (r.stack_file and not by_rank[r.rank].stack_file):
                by_rank[r.rank] = r
        hang = replace(first, ranks=[by_rank[r] for r in sorted(by_rank)])
    sizes = [w for w in (a.world_size, b.world_size) if w]
    return ManifestInfo(
        status=status,
        hang=hang,
        exits={**b.exits, **a.exits},
        world_size=max(sizes) if sizes else None,
        coverage_gaps=a.coverage_gaps + b.coverage_gaps,
        launcher_exits=a.launcher_exits + b.launcher_exits,
        command=a.command or b.command,
        busy=sorted(a.busy + b.busy, key=lambda x: x.start),
        lost_supervisors=a.lost_supervisors + b.lost_supervisors,
        stopped_at=max((t for t in (a.stopped_at, b.stopped_at) if t is not None), default=None),
    )


def load_run(
    path: Path | str, *, stream_above: int = STREAM_THRESHOLD, workers: int | None = None, note_world: bool = True
) -> RunData:
    """Read a run directory, a folder of traces, one trace file or Flight Recorder dumps.
    ``note_world=False``: ranks absent below the world size are not noted (``load_runs`` notes them
    once every part is read)."""
    path = Path(path)
    if not path.exists():
        raise MoedoctorError(f"{path}: no such file or directory", EXIT_USAGE)
    if path.is_file():
        return _finish(
            RunData(path=path, kind=SourceKind.TRACES, traces=[]), [path], stream_above, workers, note_other_ranks=True
        )
    if not path.is_dir():
        raise MoedoctorError(f"{path}: not a file or directory", EXIT_USAGE)
    layout = RunDir(path)
    if layout.manifest.exists() or layout.traces.is_dir():
        run = RunData(path=path, kind=SourceKind.RUN_DIR, traces=[])
        run.manifest = _read_manifest(layout.manifest, run.incomplete)
        run.stacks = read_stacks(layout.stacks, run.incomplete)
        run.gpus = read_gpu_snapshots(layout.gpu, run.incomplete)
        paths = trace_paths(layout.traces)
        if not paths:
            loaded = recorder_markers(layout.control)
            run.incomplete.append(
                f"no trace files in {TRACES}/: "
                + (
                    f"the recorder was loaded in rank(s) {rank_ranges(loaded, 20)}, but no rank created its default "
                    "process group (init_process_group / init_device_mesh never returned)"
                    if loaded
                    else "the recorder was not loaded in any rank, or no rank started (is moedoctor's bootstrap on the "
                    "job's Python path?)"
                )
            )
        run = _finish(run, paths, stream_above, workers, note_world=note_world)
        fuse_flight_recorder(run)  # completion the recorder could not observe, from the hang's dumps
        return run
    paths = trace_paths(path)
    if paths:
        return _finish(
            RunData(path=path, kind=SourceKind.TRACES, traces=[]), paths, stream_above, workers, note_world=note_world
        )
    return _load_flight_recorder(path)


def _finish(
    run: RunData,
    paths: list[Path],
    stream_above: int,
    workers: int | None,
    note_other_ranks: bool = False,
    note_world: bool = True,
) -> RunData:
    total = sum(_size(p) for p in paths)
    if total > stream_above:
        load_windowed(run, paths, workers=workers)
    else:
        for p in paths:
            trace = read_rank_trace(p, run.incomplete)
            if trace is not None:
                run.traces.append(trace)
    _dedupe_and_sort(run)
    if not run.windowed:
        run.last_seq, run.last_p2p = last_sequences(run.traces)
    for t in run.traces:
        if t.capped:
            run.open_ended.add(t.rank)
            run.incomplete.append(
                f"rank {t.rank}: the trace stopped at the event cap (--max-events); later collectives are not recorded"
            )
    for folder in sorted({p.parent for p in paths}):
        for rank, status in read_statuses(folder).items():
            if status["state"] == STOPPED:  # a write of the recorder's failed (disk full): it stopped there
                run.open_ended.add(rank)
                run.recording_stopped[rank] = stopped_line(status, "later collectives are not recorded")
                run.incomplete.append(run.recording_stopped[rank])
    if note_world:
        _note_world(run, note_other_ranks)
    return run


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _dedupe_and_sort(run: RunData) -> None:
    seen: dict[int, RankTrace] = {}
    for t in run.traces:
        if t.rank in seen:
            run.incomplete.append(
                f"{t.path.name}: rank {t.rank} already read from {seen[t.rank].path.name}; "
                "left out (traces of two runs in one folder?)"
            )
            continue
        seen[t.rank] = t
    run.traces = [seen[r] for r in sorted(seen)]


def _note_world(run: RunData, note_other_ranks: bool) -> None:
    sizes = {t.header.world_size for t in run.traces}
    if run.manifest is not None and run.manifest.world_size:
        sizes.add(run.manifest.world_size)
    if len(sizes) > 1:
        run.incomplete.append(f"traces disagree on the world size ({sorted(sizes)}): traces of different runs?")
    run.world_size = max(sizes) if sizes else None
    if run.world_size:
        absent = absent_ranks(run)
        if absent and (run.traces or run.kind != SourceKind.RUN_DIR or note_other_ranks):
            run.incomplete.append(
                f"no trace of rank{'s' if len(absent) > 1 else ''} {rank_ranges(absent, 20)}"
                f" (of world size {run.world_size})"
            )


def absent_ranks(run: RunData) -> list[int]:
    """Ranks below the world size without a trace. The world size is bounded at the boundary
    (``MAX_WORLD_SIZE``), and only the ranks present are hashed: no set of the whole range."""
    present = {t.rank for t in run.traces}
    return [r for r in range(min(run.world_size or 0, MAX_WORLD_SIZE)) if r not in present]


def never_started(run: RunData) -> str | None:
    """The job never started, in one line: a run directory whose job ended with no trace from any
    rank and no rank where moedoctor's recorder loaded (it failed before its process group); else None."""
    m = run.manifest
    if (
        run.traces
        or m is None
        or m.status not in ("finished", "interrupted")
        or run.kind != SourceKind.RUN_DIR
        or recorder_markers(RunDir(run.path).control)
    ):
        return None
    codes = [c for c in m.launcher_exits if c not in (None, 0)]
    how = f"the launcher exited with status {codes[0]}" if codes else "the launcher ended"
    return (
        f"the job never started: no rank wrote a trace and moedoctor's recorder loaded in no rank "
        f"({how}; see its log, {JOB_LOG})"
    )


def evidence_problem(run: RunData) -> str | None:
    """Why a verdict of healthy would have no evidence behind it, in one line; None when every
    rank that ran has a readable trace (the world size from the headers or the manifest against the
    ranks present). A healthy verdict with a reason here is bad input (exit 2), not healthy."""
    first_problem = next((line for line in run.incomplete if "left out" in line or "unreadable" in line), None)
    context = f" ({_clip(first_problem, 200)})" if first_problem else ""
    if not run.traces:
        return never_started(run) or f"{run.path}: no readable moedoctor trace, so no verdict{context}"
    if not run.world_size:
        return f"{run.path}: the world size is unknown, so a healthy verdict has no evidence{context}"
    absent = absent_ranks(run)
    if absent:
        return (
            f"{run.path}: no readable trace of rank{'s' if len(absent) > 1 else ''} {rank_ranges(absent, 20)} "
            f"(world size {run.world_size}): healthy cannot be told{context}"
        )
    if run.recording_stopped:
        first = run.recording_stopped[min(run.recording_stopped)]
        return f"{run.path}: {_clip(first, 300)}: the trace ends before the rank did, so healthy cannot be told"
    return None


def verdict_problem(run: RunData, verdict: Verdict) -> str | None:
    """Why ``verdict`` has no evidence behind it, in one line (then bad input, exit 2), or None.
    Healthy: ``evidence_problem``. Stuck, where a rank's recording stopped on a failed write and no
    hang was declared while the job ran: its trace ends at the stop, not at a hang."""
    if verdict == Verdict.HEALTHY:
        return evidence_problem(run)
    if verdict == Verdict.CRASHED and not run.traces:  # whether the runner saw the ranks die is timing
        return never_started(run)
    hang_declared = run.manifest is not None and run.manifest.hang is not None
    if verdict == Verdict.STUCK and run.recording_stopped and not hang_declared:
        return evidence_problem(run)
    return None


def _read_manifest(path: Path, incomplete: list[str]) -> ManifestInfo | None:
    if not path.exists():
        incomplete.append(f"no {MANIFEST}: rank exit statuses and the hang record are unknown")
        return None
    try:
        manifest = Manifest.read(path)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past the parser's limit
        incomplete.append(
            f"{MANIFEST} unreadable ({type(e).__name__}: {str(e)[:200]}): rank exit statuses and "
            "the hang record are unknown"
        )
        return None
    world = manifest.world_size
    info = ManifestInfo(
        status=manifest.status,
        hang=None,
        exits={},
        world_size=world if _int(world) and 0 < world <= MAX_WORLD_SIZE else None,
    )
    if _int(world) and world > MAX_WORLD_SIZE:
        incomplete.append(f"{MANIFEST}: world size {bounded_int(world)} is beyond {MAX_WORLD_SIZE}: ignored")
    command = manifest.command
    if command is not None and all(isinstance(arg, str) for arg in command[:MAX_COMMAND_ARGS]):
        info.command = command[:MAX_COMMAND_ARGS]
    nodes = manifest.nodes_raw
    if isinstance(nodes, dict):
        info.launcher_exits = [
            n.get("launcher_exit") if _int(n.get("launcher_exit")) else None
            for n in list(nodes.values())[:1000]
            if isinstance(n, dict)
        ]
    info.busy = manifest.busy
    if info.status == "running" and supervisor_alive(path.parent) is False:
        # Said by the analysis (``ManifestInfo.interruption``): the run was interrupted.
        info.lost_supervisors = _running_supervisors(nodes) or ["moedoctor, pid unknown"]
        info.stopped_at = _last_write(path.parent)
    elif info.status == "interrupted" and isinstance(nodes, dict):
        ends = [n.get("end") for n in list(nodes.values())[:1000] if isinstance(n, dict)]
        info.stopped_at = max((e for e in ends if isinstance(e, (int, float)) and 0 < e < 1e11), default=None)
    try:
        info.hang = manifest.hang
    except Exception as e:  # noqa: BLE001 - a damaged hang record leaves the rest usable
        incomplete.append(f"{MANIFEST}: hang record unreadable ({type(e).__name__})")
    ranks = manifest.ranks
    if isinstance(ranks, dict):
        for entry in ranks.values():
            try:
                exit_ = RankExit(**entry)
                if _int(exit_.rank) and (exit_.exit_code is None or _int(exit_.exit_code)):
                    info.exits[exit_.rank] = exit_
            except (TypeError, ValueError):
                incomplete.append(f"{MANIFEST}: a rank's exit entry is unreadable")
    coverage = manifest.coverage
    if coverage is not None and not coverage.get("complete", True):
        for gap in coverage.get("gaps") or ():
            if isinstance(gap, dict):
                info.coverage_gaps.append(_gap_text(gap))
    return info


def _running_supervisors(nodes: object) -> list[str]:
    """``moedoctor pid N on HOST`` of each node the manifest still shows running."""
    found = []
    for node in list(nodes.values())[:1000] if isinstance(nodes, dict) else ():
        if isinstance(node, dict) and node.get("status") == "running":
            pid, host = node.get("moedoctor_pid"), node.get("host")
            pid_text = f"pid {pid}" if _int(pid) else "pid unknown"
            found.append(f"moedoctor {pid_text} on {_clip(host, 100) if isinstance(host, str) else 'an unknown host'}")
    return found


def _last_write(run_dir: Path) -> float | None:
    """The latest modification time of the run directory's records (traces, logs, manifest): a
    supervisor killed without a word died about then (its job is stopped with it, so the ranks' last
    records are at most a second later)."""
    times = []
    for pattern in (f"{TRACES}/rank-*.jsonl", f"{TRACES}/rank-*.status", JOB_LOGS, MANIFEST):
        for p in list(run_dir.glob(pattern))[:100_000]:
            try:
                times.append(p.stat().st_mtime)
            except OSError:
                pass
    return max(times, default=None)


def _gap_text(gap: dict) -> str:
    if "problem" in gap:
        return f"rank {gap.get('rank')}: {gap['problem']}"
    return (
        f"rank {gap.get('rank')}, group {gap.get('group')}: {gap.get('recorded')} collectives recorded, "
        f"the backend counted {gap.get('backend')}"
    )


def read_stacks(folder: Path, incomplete: list[str]) -> dict[int, StackDump]:
    stacks: dict[int, StackDump] = {}
    if not folder.is_dir():
        return stacks
    for p in sorted(folder.glob(STACK_FILES)):
        try:
            dump = read_stack_dump(p)
        except Exception as e:  # noqa: BLE001
            incomplete.append(f"{STACKS}/{p.name} unreadable ({type(e).__name__})")
            continue
        stacks[dump.rank] = dump
    return stacks


def read_gpu_snapshots(folder: Path, incomplete: list[str]) -> list[GpuSnapshot]:
    snapshots: list[GpuSnapshot] = []
    if not folder.is_dir():
        return snapshots
    for p in sorted(folder.glob("*.json")):
        try:
            raw = json.loads(p.read_text())
            snapshots.append(_gpu(raw, p.stem))
        except Exception as e:  # noqa: BLE001
            incomplete.append(f"{GPU}/{p.name} unreadable ({type(e).__name__})")
    return snapshots


def _gpu(raw: dict, host: str) -> GpuSnapshot:
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if not raw.get("available"):
        return GpuSnapshot(str(raw.get("host", host)), False, str(raw.get("reason") or "unavailable"))
    devices: list = []
    for d in raw.get("gpus") or ():
        util = d.get("utilization") or {}
        mem = d.get("memory") or {}
        ecc = d.get("ecc_errors") or {}
        retired = d.get("retired_pages") or {}
        remap = d.get("remapped_rows") or {}
        devices.append(
            GpuDevice(
                index=int(d.get("index", len(devices))),
                name=d.get("name"),
                utilization=util.get("gpu"),
                memory_used=mem.get("used"),
                memory_total=mem.get("total"),
                ecc_uncorrected=ecc.get("volatile_uncorrected"),
                retired_pending=retired.get("pending"),
                remapped_failure=bool(remap.get("failure")) if remap else None,
                processes=len(d.get("processes") or ()),
            )
        )
    return GpuSnapshot(str(raw.get("host", host)), True, None, tuple(devices))


# ---- Flight Recorder ----------------------------------------------------------------------------


def _load_flight_recorder(path: Path) -> RunData:
    try:
        from moedoctor.trace import flight_recorder
    except ImportError:
        flight_recorder = None
    if flight_recorder is None:
        if _looks_like_flight_recorder(path):
            raise MoedoctorError(
                f"{path} looks like Flight Recorder dumps, which this moedoctor cannot read yet "
                "(moedoctor.trace.flight_recorder is not installed)",
                EXIT_USAGE,
            )
        raise MoedoctorError(_nothing_here(path), EXIT_USAGE)
    if not flight_recorder.is_flight_recorder_dir(path):
        raise MoedoctorError(_nothing_here(path), EXIT_USAGE)
    try:
        fr = flight_recorder.read_flight_recorder(path)
    except MoedoctorError:
        raise
    except Exception as e:  # noqa: BLE001 - a reader failure is bad input, not a crash
        raise MoedoctorError(
            f"{path}: Flight Recorder dumps could not be read ({type(e).__name__}: {e})", EXIT_USAGE
        ) from None
    if fr.traces and not any(t.events for t in fr.traces):
        raise MoedoctorError(
            f"{path}: the Flight Recorder dumps hold no entries: Flight Recorder was off "
            "(TORCH_FR_BUFFER_SIZE=0), or the wrong buffer was dumped (NCCL jobs keep theirs in "
            "_dump_nccl_trace, not _dump_fr_trace). Nothing to analyze.",
            EXIT_USAGE,
        )
    run = RunData(path=path, kind=SourceKind.FLIGHT_RECORDER, traces=list(fr.traces))
    run.incomplete.extend(fr.incomplete)
    _dedupe_and_sort(run)
    run.last_seq, run.last_p2p = last_sequences(run.traces)
    _note_world(run, note_other_ranks=True)
    return run


def _nothing_here(path: Path) -> str:
    return (
        f"{path}: nothing to analyze: not a moedoctor run directory ({MANIFEST}, {TRACES}/), no "
        "moedoctor traces (rank-*.jsonl) and no Flight Recorder dumps"
    )


def _looks_like_flight_recorder(path: Path) -> bool:
    for p in sorted(path.iterdir())[:64]:
        if not p.is_file():
            continue
        try:
            with open(p, "rb") as f:
                head = f.read(65536)
        except OSError:
            continue
        if head[:1] == b"\x80" or (head.lstrip()[:1] == b"{" and (b'"entries"' in head or b'"pg_config"' in head)):
            return True
    return False
