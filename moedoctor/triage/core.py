"""``triage(pid, out_dir) -> TriageResult``: examine a running, stuck job from outside, without
stopping it.

1. Resolve PID: a rank (``RANK`` in its environment: the job is it and its sibling ranks under the
   same launcher) or a launcher (torchrun, the elastic agent, ``moedoctor run``: the ranks among its
   descendants).
2. Collect into ``out_dir``, laid out like a run directory: every local rank's stacks in parallel
   (``stacks/``, py-spy), the NVML snapshot (``gpu/``), Flight Recorder dumps through the job's debug
   pipe where it set one (``flight_recorder/``), and the job's moedoctor traces when it runs under
   ``moedoctor run`` (``traces/``, after asking its recorders for a snapshot record).
3. Analyze: the traces or the Flight Recorder dumps with the fresh stacks (``analyze``), else the
   stacks alone (``report_from_stacks``; where ranks wait in different collectives with no majority,
   the ranks past a loop the others wait inside are named the culprits: ``loop_exit.py``).
4. Busy is not stuck (``moedoctor.rank_states``): over ``progress_window`` seconds (2 by default,
   while the rest is collected) each rank's main-thread CPU, I/O and stack are read twice; when the
   ranks the others wait for are working and progressing, the report says *slow*, with the phase
   and the rank, not a straggler hang.

Nothing is signalled. ``py-spy dump`` stops each rank for the few milliseconds it takes to read its
stack (ptrace), as any ``py-spy dump`` does; ranks already stopped (state T) or stuck in the kernel
(state D) are read with ``--nonblocking`` instead, which never attaches, so their state is left as
it was.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.analysis import analyze, load_runs
from moedoctor.analysis.from_stacks import report_from_stacks
from moedoctor.analysis.loading.load import read_gpu_snapshots
from moedoctor.analysis.diagnosis import slow_not_stuck
from moedoctor.analysis.model import Report, Verdict
from moedoctor import environment
from moedoctor.errors import EXIT_USAGE, MoedoctorError
from moedoctor.rank_states import Judgement, judge
from moedoctor.runner import procs
from moedoctor.runner.activity import Activity, sample_stacks
from moedoctor.runner.gpu import write_gpu_snapshot
from moedoctor.runner.rundir import RunDir
from moedoctor.runner.stacks import StackDump, StackTarget, dump_stacks, find_py_spy
from moedoctor.triage import discover
from moedoctor.triage.flight_recorder import FlightRecorderResult, trigger_dumps
from moedoctor.triage.loop_exit import name_culprit

#: Traces up to this size are copied into the triage folder; larger ones are linked.
COPY_TRACES_BELOW = 64 << 20
#: Process states in which ptrace must not be used (it would not return, or would change the state).
_NO_ATTACH = ("T", "t", "D")


@dataclass
class RankProcess:
    rank: int
    pid: int
    state: str
    env: dict[str, str]
    world_size: int | None = None  # when known otherwise than from WORLD_SIZE in env (discover.py)


@dataclass
class TriageResult:
    """What triage found and where it put it. ``evidence`` is what the report was built from:
    ``traces``, ``flight-recorder`` or ``stacks``."""

    pid: int
    launcher: int | None
    ranks: list[RankProcess]
    out_dir: Path
    stacks: dict[int, StackDump]
    gpu: dict
    flight_recorder: FlightRecorderResult
    run_dir: Path | None
    evidence: str
    report: Report
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "pid": self.pid,
            "launcher": self.launcher,
            "out_dir": str(self.out_dir),
            "evidence": self.evidence,
            "ranks": {
                str(r.rank): {
                    "pid": r.pid,
                    "state": r.state,
                    "stack_error": self.stacks[r.rank].error if r.rank in self.stacks else None,
                }
                for r in self.ranks
            },
            "gpu": {"available": bool(self.gpu.get("available")), "reason": self.gpu.get("reason")},
            "flight_recorder": {
                "enabled": self.flight_recorder.enabled,
                "dumps": {str(r): str(p) for r, p in sorted(self.flight_recorder.dumps.items())},
            },
            "run_dir": None if self.run_dir is None else str(self.run_dir),
            "notes": self.notes,
        }


def triage(
    pid: int,
    out_dir: Path,
    *,
    native: bool = False,
    flight_recorder: bool = True,
    fr_wait: float = 5.0,
    snapshot_wait: float = 1.5,
    host: str | None = None,
    progress_window: float = 2.0,
) -> TriageResult:
    """Examine the job PID belongs to; raise ``MoedoctorError`` when PID is no torch job or nothing
    could be read."""
    host = host or socket.gethostname()
    launcher, ranks, found_how = find_ranks_and_how(pid)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise MoedoctorError(f"{out_dir} is not empty: choose another --out", EXIT_USAGE)
    out_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = list(found_how)
    run_dir = _job_run_dir(ranks)
    requested = _request_snapshot(run_dir) if run_dir is not None else None
    activity, watch_start = Activity(), time.monotonic()
    activity.sample({r.rank: r.pid for r in ranks})

    stacks = _dump_all(ranks, RunDir(out_dir).stacks, host, native)
    if stacks and all(d.error for d in stacks.values()):
        first = next(iter(stacks.values())).error
        if "permission" in first or find_py_spy() is None:
            raise MoedoctorError(f"could not read any rank's stack: {first}", EXIT_USAGE)
    gpu_path = write_gpu_snapshot(RunDir(out_dir).gpu, host)
    gpu = json.loads(gpu_path.read_text())
    if not gpu.get("available"):
        notes.append(f"NVML absent: no GPU info ({gpu.get('reason')})")

    fr = FlightRecorderResult()
    if flight_recorder:
        fr = trigger_dumps({r.rank: (r.pid, r.env) for r in ranks}, RunDir(out_dir).flight_recorder, wait=fr_wait)
        notes.extend(fr.notes)
        if not fr.enabled:
            notes.append(
                "Flight Recorder: the job set no TORCH_NCCL_DEBUG_INFO_PIPE_FILE, so no dump can be "
                "asked for (NCCL only: Gloo has no such trigger)"
            )
    else:
        notes.append("Flight Recorder: not asked (--no-flight-recorder)")

    traces = False
    if run_dir is not None:
        if requested is not None:
            _await(requested, snapshot_wait)
        traces = _take_traces(run_dir, out_dir, notes)
    report, evidence = _report(out_dir, stacks, ranks, traces, fr, notes)
    progress = _progress(ranks, stacks, activity, watch_start, progress_window)
    if progress is not None:
        notes.append(f"progress over {progress_window:g} s: {progress.line}")
        if progress.kind.value == "busy" and report.verdict == Verdict.STUCK and report.pattern in (None, "straggler"):
            report = slow_not_stuck(report, progress.line)
    if evidence == "traces" and report.verify_command and run_dir is not None:
        # verify replays the job's own run directory (its manifest holds the command), not this copy
        report.verify_command = report.verify_command.replace(str(out_dir), str(run_dir))
    result = TriageResult(
        pid=pid,
        launcher=launcher,
        ranks=ranks,
        out_dir=out_dir,
        stacks=stacks,
        gpu=gpu,
        flight_recorder=fr,
        run_dir=run_dir,
        evidence=evidence,
        report=report,
        notes=notes,
    )
    try:  # what merge_triages needs from this node: the ranks' states and the job's world size
        (out_dir / TRIAGE_FILE).write_text(json.dumps({**result.to_dict(), "world_size": _world(ranks)}, indent=1))
    except OSError as e:
        notes.append(f"{TRIAGE_FILE} not written ({e.strerror or e})")
    return result


TRIAGE_FILE = "triage.json"


def _progress(
    ranks: list[RankProcess], stacks: dict[int, StackDump], activity: Activity, start: float, window: float
) -> Judgement | None:
    """Whether the ranks progress: main-thread CPU and I/O since ``start``, and a second stack sample
    (``py-spy --nonblocking``) against the dump, over at least ``window`` seconds (None: no window)."""
    if window <= 0 or not ranks:
        return None
    time.sleep(max(0.0, start + window - time.monotonic()))
    pids = {r.rank: r.pid for r in ranks}
    for rank, dump in stacks.items():
        activity.note_stack(rank, dump.main_thread)
    for rank, dump in sample_stacks(pids, find_py_spy()).items():
        activity.note_stack(rank, dump.main_thread)
    activity.sample(pids)
    evidence = [
        activity.evidence(
            r.rank,
            stacks.get(r.rank),
            alive=procs.stat(r.pid) is not None,
            frozen=stacks[r.rank].frozen if r.rank in stacks else None,
        )
        for r in ranks
    ]
    elapsed = time.monotonic() - start
    return judge(evidence, elapsed * 0.9, elapsed)


def merge_triages(dirs: list[Path]) -> tuple[Report, str, list[str]]:
    """One report from the triage folders of a multi-node job's nodes (``moedoctor triage --pid`` run
    on each node, the folders gathered): ``(report, evidence, notes)``. The stacks, GPU snapshots and
    ranks' states of every node are merged; the traces of the nodes that have them (jobs under
    ``moedoctor run``) are analyzed together (``load_runs``), else the Flight Recorder dumps of every
    node together, else the stacks alone."""
    from moedoctor.analysis.loading.load import read_stacks

    notes: list[str] = []
    stacks: dict[int, StackDump] = {}
    states: dict[int, str] = {}
    gpus = []
    worlds = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise MoedoctorError(f"{d}: no such triage folder", EXIT_USAGE)
        for rank, dump in read_stacks(RunDir(d).stacks, notes).items():
            if rank in stacks:
                notes.append(f"{d}: rank {rank} already read from another folder; left out")
                continue
            stacks[rank] = dump
        gpus += read_gpu_snapshots(RunDir(d).gpu, notes)
        try:
            info = json.loads((d / TRIAGE_FILE).read_text())
            states.update({int(r): v["state"] for r, v in info.get("ranks", {}).items()})
            if isinstance(info.get("world_size"), int):
                worlds.append(info["world_size"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            notes.append(f"{d}: no readable {TRIAGE_FILE} (ranks' process states and world size unknown)")
    if not stacks:
        raise MoedoctorError(f"no rank's stack in {', '.join(map(str, dirs))}: not triage folders?", EXIT_USAGE)
    world = max(worlds) if worlds else None
    source = " + ".join(str(d) for d in dirs)
    from_stacks = name_culprit(
        report_from_stacks(stacks, source=source, world_size=world, gpus=gpus, states=states), stacks
    )
    traced = [Path(d) for d in dirs if RunDir(Path(d)).traces.is_dir()]
    fr = [RunDir(Path(d)).flight_recorder for d in dirs if any(RunDir(Path(d)).flight_recorder.glob("fr_rank_*"))]
    report, evidence = _best_report(
        ((traced, "traces"), (fr, "flight-recorder")), stacks, lambda incomplete: gpus, from_stacks, notes
    )
    return report, evidence, notes


def _best_report(
    sources, stacks: dict[int, StackDump], gpus, from_stacks: Report, notes: list[str]
) -> tuple[Report, str]:
    """The report of the first of ``sources`` (``(paths, label)``: traces, then Flight Recorder dumps)
    that loads, with the fresh ``stacks``; the stacks' own report when none does, or when it finds
    nothing the stacks do (recorded up to a moment ago). ``gpus(incomplete)``: the GPU snapshots."""
    for paths, label in sources:
        if not paths:
            continue
        try:
            run = load_runs(paths)
        except MoedoctorError as e:
            notes.append(f"{label}: not analyzed ({e.message})")
            continue
        run.stacks = stacks
        if not run.gpus:
            run.gpus = gpus(run.incomplete)
        report = analyze(run)
        if report.verdict == Verdict.HEALTHY and from_stacks.verdict != Verdict.HEALTHY:
            notes.append(f"the {label} show no problem yet (recorded up to a moment ago); the report is the stacks'")
            return from_stacks, "stacks"
        return report, label
    return from_stacks, "stacks"


def _world(ranks: list[RankProcess]) -> int | None:
    known = next((r.world_size for r in ranks if r.world_size), None)
    return known or next((int(r.env["WORLD_SIZE"]) for r in ranks if r.env.get("WORLD_SIZE", "").isdigit()), None)


# ---- which processes ----------------------------------------------------------------------------


def find_ranks(pid: int) -> tuple[int | None, list[RankProcess]]:
    """(launcher pid or None, the job's rank processes on this node) for a rank's or a launcher's PID."""
    launcher, ranks, _ = find_ranks_and_how(pid)
    return launcher, ranks


def find_ranks_and_how(pid: int) -> tuple[int | None, list[RankProcess], list[str]]:
    """``find_ranks`` and how the ranks were identified, when not by ``RANK`` in their environment
    (discover.py: moedoctor's traces, the rendezvous store), with the pids left unidentified."""
    if not Path(f"/proc/{pid}").exists() or not procs.is_alive(pid):
        raise MoedoctorError(f"no such process: {pid}", EXIT_USAGE)
    env = procs.environ(pid)
    if env is None:
        why = (
            "moedoctor runs as root, so /proc is restricted here (hidepid, another PID namespace, or a "
            "container without CAP_SYS_PTRACE): run moedoctor triage inside the job's container"
            if os.geteuid() == 0
            else "it belongs to another user; run moedoctor triage as that user or as root"
        )
        raise MoedoctorError(f"cannot read the environment of pid {pid} ({_command(pid)}): {why}", EXIT_USAGE)
    if "RANK" in env:
        parent = _ppid(pid)
        siblings = procs.rank_processes(procs.job_processes(parent)) if parent and parent > 1 else {}
        same = {r: p for r, p in siblings.items() if _same_job(procs.environ(p.pid) or {}, env)}
        if pid in {p.pid for p in same.values()}:
            return parent, _ranked(same), []
        rank = int(env["RANK"]) if env["RANK"].isdigit() else 0
        return None, _ranked({rank: procs.JobProcess(pid, parent or 0, rank, None, None)}), []
    family = procs.job_processes(pid)
    found = procs.rank_processes(family)
    if found:
        return pid, _ranked(found), []
    family_pids = [p.pid for p in family]
    discovered = discover.from_traces(family_pids) or discover.from_store(pid, family_pids[1:])
    if discovered is None:
        raise MoedoctorError(
            f"pid {pid} ({_command(pid)}) is not a torch distributed job: no process with RANK in "
            "its environment under it, no moedoctor trace, and no process group's rendezvous store "
            "that it or a process under it is connected to. Give the pid of a rank, of its launcher "
            "(torchrun, mp.spawn's or Lightning's parent, a Ray driver that started its cluster) or of "
            "the job's root.",
            EXIT_USAGE,
        )
    ranks = [
        RankProcess(r, p, _state(p), procs.environ(p) or {}, discovered.world_size)
        for r, p in sorted(discovered.ranks.items())
    ]
    return (pid if pid not in discovered.ranks.values() else None), ranks, discovered.notes()


def _ranked(found: dict[int, procs.JobProcess]) -> list[RankProcess]:
    return [RankProcess(r, p.pid, _state(p.pid), procs.environ(p.pid) or {}) for r, p in sorted(found.items())]


def _same_job(a: dict[str, str], b: dict[str, str]) -> bool:
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    return all(a.get(k) == b.get(k) for k in keys)


def _ppid(pid: int) -> int | None:
    st = procs.stat(pid)
    return st[0] if st else None


def _state(pid: int) -> str:
    st = procs.stat(pid)
    return st[1] if st else "?"


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return raw[:120] + ("..." if len(raw) > 120 else "") if raw else "?"


# ---- collecting ---------------------------------------------------------------------------------


def _dump_all(ranks: list[RankProcess], folder: Path, host: str, native: bool) -> dict[int, StackDump]:
    targets = [StackTarget(r.rank, r.pid, nonblocking=r.state in _NO_ATTACH) for r in ranks]
    return {d.rank: d for d in sorted(dump_stacks(targets, folder, host, native), key=lambda d: d.rank)}


def _job_run_dir(ranks: list[RankProcess]) -> Path | None:
    for r in ranks:
        run_dir = environment.run_dir(r.env)
        path = procs.path_of(r.pid, run_dir) if run_dir else None
        if path is not None and path.is_dir():
            return path
    return None


def _request_snapshot(run_dir: Path) -> float | None:
    """Ask the job's recorders for their counts so far, as ``moedoctor run``'s watchdog does."""
    try:
        return RunDir(run_dir).request_snapshot()
    except OSError:
        return None


def _await(since: float, wait: float) -> None:
    remaining = since + wait - time.time()
    if remaining > 0:
        time.sleep(remaining)


def _take_traces(run_dir: Path, out_dir: Path, notes: list[str]) -> bool:
    src = RunDir(run_dir)
    files = sorted(src.traces.glob("rank-*.jsonl*")) if src.traces.is_dir() else []
    if not files:
        notes.append(f"the job runs under moedoctor ({run_dir}) but wrote no traces yet")
        return False
    size = sum(f.stat().st_size for f in files)
    if size < COPY_TRACES_BELOW:
        shutil.copytree(src.traces, RunDir(out_dir).traces)
    else:
        RunDir(out_dir).traces.symlink_to(src.traces.resolve(), target_is_directory=True)
        notes.append(f"traces are {size >> 20} MiB: linked, not copied, from {src.traces}")
    if src.manifest.exists():
        shutil.copyfile(src.manifest, RunDir(out_dir).manifest)
    notes.append(f"moedoctor traces read from {run_dir}")
    return True


# ---- the report ---------------------------------------------------------------------------------


def _report(
    out_dir: Path,
    stacks: dict[int, StackDump],
    ranks: list[RankProcess],
    traces: bool,
    fr: FlightRecorderResult,
    notes: list[str],
) -> tuple[Report, str]:
    states = {r.rank: r.state for r in ranks}
    world = _world(ranks)
    from_stacks = name_culprit(
        report_from_stacks(
            stacks,
            source=str(out_dir),
            world_size=world,
            gpus=read_gpu_snapshots(RunDir(out_dir).gpu, []),
            states=states,
        ),
        stacks,
    )
    sources = (
        ([out_dir] if traces else [], "traces"),
        ([RunDir(out_dir).flight_recorder] if fr.dumps else [], "flight-recorder"),
    )
    return _best_report(
        sources, stacks, lambda incomplete: read_gpu_snapshots(RunDir(out_dir).gpu, incomplete), from_stacks, notes
    )
