"""``run_job``: start a job (torchrun, or any command: ``runner/ranks.py``) with the recorder injected,
watch it for hangs and (online) for desyncs, diagnose and stop it, and record the run in its run
directory. The CLI's ``moedoctor run`` is a thin shell around this; what the user sees is the
``RunObserver``'s business."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from importlib import metadata
from pathlib import Path

import moedoctor
from moedoctor import environment
from moedoctor.errors import EXIT_HANG, EXIT_INTERRUPTED, MoedoctorError, cannot_write
from moedoctor.run_status import RankStatus, RunStatus  # noqa: F401 - a shared leaf; re-exported here
from moedoctor.rank_states import Judgement, Pending, RankEvidence, RankState, Silence, judge
from moedoctor.runner import procs
from moedoctor.runner.activity import Activity, device_wait, sample_stacks
from moedoctor.runner.collect import HangEvidence
from moedoctor.runner.control import ENV_LAUNCH_ID, JobControl, _torchrun_failures  # noqa: F401 - re-exported
from moedoctor.runner.manifest import (
    Key,
    NodeKey,
    BusyRecord,
    CoverageCheck,
    HangRecord,
    NodeRecord,
    Status,
    coverage_check,
    read_nodes,
    relevant_env,
    write_node,
)
from moedoctor.runner.exchange import Exchange, store_of
from moedoctor.runner.online import Desync, DesyncDetector, Lag
from moedoctor.runner.progress import ProgressTracker, RankProgress
from moedoctor.runner.rundir import RunDir
from moedoctor.runner.stacks import StackDump, find_py_spy
from moedoctor.trace.format import recorder_markers

EXIT_NOT_FOUND = 127


#: Seconds of silence of the collectives after which they are judged (a hang only when the ranks are
#: proven to wait on each other): the default of ``--hang-timeout``.
DEFAULT_HANG_TIMEOUT = 180.0
#: Seconds allowed before any rank has opened its trace (imports, rendezvous): the default of
#: ``--startup-timeout``.
DEFAULT_STARTUP_TIMEOUT = 300.0


@dataclass(frozen=True)
class RunConfig:
    """Everything ``run_job`` needs; built by the CLI from its options."""

    command: list[str]
    run_dir: Path
    env: Mapping[str, str]  # the environment to start the job in
    hang_timeout: float = DEFAULT_HANG_TIMEOUT  # ranks proven to wait on each other with no progress this long = hang
    max_busy: float | None = None  # --max-busy: stop a silence this long even when the ranks are busy
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT  # allowance before any rank has opened its trace
    keep_alive: bool = False
    online: bool = True  # online desync detection (a desync is diagnosed as a hang)
    stacks: bool = True
    native: bool = False
    max_events: int | None = None
    recorder: str = "python"  # "native" (C++ kernel, built beforehand) or "python"
    joined: bool = False  # another node already runs this job in run_dir
    fixes: tuple[str, ...] = ()  # fix modules injected into every worker
    fix_config: Path | None = None  # their normalized --config (JSON), if any
    fix_checks: bool = False  # run the fixes' numerical checks (moedoctor verify)
    check_params: int | None = None  # --check-params: fingerprint parameters after this optimizer step
    stop_grace: float = 5.0  # SIGTERM -> SIGKILL
    coverage_wait: float = 1.0  # after a snapshot request, before stopping the job
    peer_wait: float = 10.0  # a shared run directory: how long to wait for the other nodes' stacks
    exchange: bool = True  # multi-node: exchange digests through the job's rendezvous store (exchange.py)
    poll_interval: float = 0.5
    host: str = field(default_factory=socket.gethostname)


class Outcome(str, Enum):
    FINISHED = "finished"  # the job ended by itself
    HANG = "hang"  # a hang was detected (the job stopped unless keep_alive)
    INTERRUPTED = "interrupted"  # KeyboardInterrupt: the job was stopped


@dataclass
class RunResult:
    outcome: Outcome
    exit_code: int  # what moedoctor should exit with
    job_exit: int | None  # the launcher's own status (None when it was stopped)
    run_dir: RunDir
    hang: HangRecord | None = None
    coverage: CoverageCheck | None = None


class RunObserver:
    """Hooks ``run_job`` calls as the run goes; the default does nothing. ``output`` is called
    from reader threads, the others from the thread running ``run_job``."""

    def started(self, run_dir: RunDir, launcher_pid: int, joined: bool) -> None: ...
    def output(self, data: bytes, stream: int) -> None: ...  # stream: 1 stdout, 2 stderr
    def status(self, status: RunStatus) -> None: ...
    def hang_detected(self, status: RunStatus, proof: str | None = None) -> None: ...
    def desync_detected(self, desync: Desync, status: RunStatus) -> None: ...  # diagnosis follows
    def lag_detected(self, lag: Lag) -> None: ...  # reported only; the run goes on
    def busy(self, judgement: Judgement) -> None: ...  # silent past the timeout, not a hang: the run goes on
    def diagnosed(self, hang: HangRecord) -> None: ...  # stacks, GPU state, manifest written
    # moedoctor's own trouble, one line each, said once; the job goes on:
    def recording_stopped(self, line: str) -> None: ...  # a rank's recorder stopped (a failed write)
    def write_failed(self, line: str) -> None: ...  # a write of the supervisor's failed (manifest, stacks, log)
    def stopping(self, outcome: Outcome) -> None: ...


def job_environment(config: RunConfig, run_dir: RunDir, launch_id: str) -> dict[str, str]:
    """The job's environment: the recorder's bootstrap first on PYTHONPATH, then this package."""
    env = dict(config.env)
    package = Path(moedoctor.__file__).resolve().parent
    path = [str(package / "_bootstrap"), str(package.parent)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env[environment.RUN_DIR.name] = str(run_dir.path)
    env[environment.LAUNCH_ID.name] = launch_id
    if config.max_events is not None:
        env[environment.MAX_EVENTS.name] = str(config.max_events)
    env[environment.NATIVE.name] = "1" if config.recorder == "native" else "0"
    env.pop(environment.CHECK_PARAMS.name, None)
    if config.check_params is not None:
        env[environment.CHECK_PARAMS.name] = str(config.check_params)
    for var in environment.FIX_VARIABLES:
        env.pop(var.name, None)  # only what this run asks for
    if config.fixes:
        env[environment.FIXES.name] = ",".join(config.fixes)
        if config.fix_config is not None:
            env[environment.FIX_CONFIG.name] = str(config.fix_config)
        if config.fix_checks:
            env[environment.FIX_CHECKS.name] = "1"
    return env


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that makes the launcher get ``sig`` when moedoctor dies, however it dies
    (``kill -9`` included): torchrun then stops its workers, so the job never runs on unsupervised.
    Linux only (``prctl(PR_SET_PDEATHSIG)``); None elsewhere. The signal follows the death of the
    *thread* that starts the job, so ``run_job`` must run in a thread that lives as long as the run.
    With ``--keep-alive`` it is not set: the job is meant to outlive moedoctor's verdict."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: nothing to load after
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # moedoctor died before the prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def run_job(config: RunConfig, observer: RunObserver | None = None) -> RunResult:
    """Run the job to its end, or until a hang is diagnosed (and the job stopped), or until
    interrupted (``KeyboardInterrupt``: the job is stopped, the manifest finalized)."""
    return _Run(config, observer or RunObserver()).run()


def _versions() -> dict[str, str]:
    try:
        torch_version = metadata.version("torch")  # without importing torch: seconds saved
    except metadata.PackageNotFoundError:
        torch_version = None
    return {
        Key.MOEDOCTOR_VERSION: moedoctor.__version__,
        Key.TORCH_VERSION: torch_version,
        Key.PYTHON_VERSION: platform.python_version(),
    }


class _Run:
    def __init__(self, config: RunConfig, observer: RunObserver):
        self.config = config
        self.observer = observer
        self.dir = RunDir(Path(config.run_dir).resolve())
        self.launch_id = uuid.uuid4().hex
        self.node = NodeRecord(
            node=f"{config.host}:{os.getpid()}", host=config.host, moedoctor_pid=os.getpid(), start=time.time()
        )
        self.detector = DesyncDetector() if config.online else None
        self.tracker = ProgressTracker(self.dir.traces, listener=self._feed if config.online else None)
        self.exchange: Exchange | None = None  # multi-node, online: started with the job
        # The run's three jobs beside this watchdog: the processes, and the evidence of a hang.
        self.control = JobControl(config, observer, self.launch_id, self.tracker)
        self.evidence = HangEvidence(config, self.dir, self.tracker, self._write_failed)
        self.silence: str | None = None  # why the traces' silence is no hang (a rank stopped recording...)
        self._said: set[str] = set()  # the write failures already reported
        # Busy is not stuck (rank_states): progress meters, stack samples, the current silence's account.
        self.activity = Activity()
        self.py_spy = find_py_spy() if config.stacks else None
        self._stacks_at = 0.0  # when the ranks' stacks were last sampled
        self._stacks: dict[int, StackDump] = {}
        self._silence_of: float | None = None  # the tracker's last progress this silence started from
        self._judgement: Judgement | None = None
        self._judged_at = 0.0
        self._busy_written = 0.0
        self._trigger = "hang"  # what declared a hang that is not proven here: max-busy, or a peer's proof
        self._device_waits: dict[tuple, str | None] = {}  # (rank, stack) -> the device wait it spins in

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> RunResult:
        for folder in (self.dir.traces, self.dir.control):
            folder.mkdir(parents=True, exist_ok=True)
        env = job_environment(self.config, self.dir, self.launch_id)
        self.node.env = relevant_env(env)
        self._write_manifest()
        # The first node logs to job.log; nodes that join write their own file beside it.
        self.node.log = str(self.dir.node_log(self.node.node) if self.config.joined else self.dir.job_log)
        with _JobLog(Path(self.node.log), self._write_failed) as log:
            try:
                pumps = self.control.start(env, None if self.config.keep_alive else die_with_parent(), log)
            except OSError as e:
                self._finish(Status.FINISHED, EXIT_NOT_FOUND)
                raise MoedoctorError(f"cannot start {self.config.command[0]!r}: {e.strerror}", EXIT_NOT_FOUND) from None
            assert self.control.proc is not None
            self.observer.started(self.dir, self.control.proc.pid, self.config.joined)
            store = store_of(self.config.command) if self.config.online and self.config.exchange else None
            if store is not None:
                self.exchange = Exchange(*store).start()
            try:
                result = self._watch()
            except BaseException as e:
                # Whatever went wrong here, no process of the job may outlive moedoctor.
                outcome = Outcome.INTERRUPTED
                try:
                    self.observer.stopping(outcome)
                except Exception:
                    pass
                if isinstance(e, KeyboardInterrupt):
                    self.evidence.last_coverage()
                self.control.stop()
                self._finish(Status.INTERRUPTED, None)
                if isinstance(e, KeyboardInterrupt):
                    result = RunResult(outcome, EXIT_INTERRUPTED, None, self.dir, self.node.hang, self._coverage())
                else:
                    raise
            finally:
                for pump in pumps:
                    pump.join(timeout=2)
                if self.exchange is not None:
                    self.exchange.close()
        return result

    def _feed(self, rank: int, items: list, restarted: bool) -> None:
        """The tracker's listener: every rank to the detector; this node's own ranks to the exchange."""
        if self.detector is not None:
            self.detector.feed(rank, items, restarted)
        if self.exchange is not None and self.control.is_local(rank):
            self.exchange.feed(rank, items, restarted)

    def _watch(self) -> RunResult:
        hang: HangRecord | None = None
        armed, progress_at_hang = True, None
        desync_reported = no_trace_reported = False
        next_scan = 0.0
        while True:
            assert self.control.proc is not None
            code = self.control.proc.poll()
            if code is not None:
                return self._ended(code, hang)
            self.tracker.poll()
            self._check_recording()
            now = time.monotonic()
            desync = None
            if self.detector is not None:
                self._report_lags(now)
                if self.detector.desync is not None and not desync_reported:
                    desync, desync_reported = self.detector.desync, True
                    if self.exchange is not None:
                        self.exchange.publish(desync)  # the other nodes stop theirs
            if self.exchange is not None and not desync_reported:
                self.exchange.progress = {r: p for r, p in self.tracker.ranks.items() if self.control.is_local(r)}
                if self.exchange.desync is not None:  # found by the coordinator, maybe on another node
                    desync, desync_reported = self.exchange.desync, True
            if desync is not None and self.exchange is not None:
                self.exchange.close()  # told (or told the others): done before the job stops
            if desync is None and now >= next_scan:
                self.control.scan()
                self.activity.sample(self.control.local_pids())
                next_scan = now + 1.0
            status = self._status(now)
            last = self.tracker.last_progress()
            if not armed and last != progress_at_hang:
                armed = True  # progress again after a kept-alive hang: watch for the next one
            silent = status.idle_seconds >= min(status.limit, self.config.hang_timeout) and self._silence_explained()
            quiet = status.idle_seconds >= self.config.hang_timeout and status.limit > self.config.hang_timeout
            if last is None and not no_trace_reported and not silent and quiet and self._startup_quiet():
                # No rank has a trace after --hang-timeout: say where the ranks are (stacks) and why
                # nothing was recorded, now; but stop the job only at the startup allowance, since
                # loading and rendezvous before the first process group can legitimately take that long.
                no_trace_reported = True
                self._diagnose(status, no_trace=True)
            # A hang is ranks proven to wait on each other (rank_states); before any trace, the
            # startup allowance applies as it always did.
            proof = last is None
            if desync is None and armed and not silent and last is not None:
                proof = self._watch_silence(status, now)
            self.observer.status(status)
            if desync is not None or (armed and not silent and status.idle_seconds >= status.limit and proof):
                hang = self._diagnose(status, desync, judgement=self._judgement if desync is None else None)
                if not self.config.keep_alive:
                    self.observer.stopping(Outcome.HANG)
                    self.control.stop()
                    self._finish(Status.HANG, None, hang)
                    return RunResult(Outcome.HANG, EXIT_HANG, None, self.dir, hang, self._coverage())
                armed, progress_at_hang = False, last
            time.sleep(self.config.poll_interval)

    # -- busy is not stuck -------------------------------------------------------------------------

    def _watch_silence(self, status: RunStatus, now: float) -> bool:
        """Measure the ranks while the collectives are silent; past the timeout, judge the silence.
        True when a hang is proven (or ``--max-busy`` ran out); a busy or unproven silence is
        reported and recorded, and the job goes on."""
        last = self.tracker.last_progress()
        if last != self._silence_of:  # collectives moved: a new silence, judged on its own samples
            if self._silence_of is not None:
                self._close_busy()
            self._silence_of = last
            self.activity.new_silence()
            self._stacks, self._judgement = {}, None
            self._device_waits.clear()
            if self.exchange is not None:
                self.exchange.local_states = None
        pids = self.control.local_pids()
        timeout = self.config.hang_timeout
        if status.idle_seconds >= timeout / 2 and self.py_spy is not None:
            every = min(max(2.0, timeout / 4), 30.0)
            if now - self._stacks_at >= every or (status.idle_seconds >= timeout and now - self._stacks_at >= 1.0):
                self._stacks_at = now
                sampled = sample_stacks(pids, self.py_spy)
                for rank, dump in sampled.items():
                    self.activity.note_stack(rank, dump.main_thread)
                # A rank py-spy could not read this time (a non-blocking read of a busy rank's frames
                # fails at times) keeps its last stack of this silence: where it works is not lost.
                self._stacks = {**self._stacks, **sampled}
        if status.idle_seconds < min(status.limit, timeout / 2) or now - self._judged_at < 1.0:
            return self._judgement is not None and self._judgement.proven and status.idle_seconds >= status.limit
        self._judged_at = now
        # The traces and the meters were last read before the stack sample above, which can take
        # seconds (py-spy on a loaded host): read both again. Collectives that moved meanwhile end
        # this silence (judged now, it would mix an old silence with ranks seen later: a rank that
        # left the barrier and exited, judged dead); and the time spent sampling must not count as
        # every rank's silence, or a rank working all along would be judged to make no progress.
        if self._silence_ended():
            return False
        self.activity.sample(pids)
        evidence = {rank: self._evidence(rank, t, pids) for rank, t in sorted(self.tracker.ranks.items())}
        if self._silence_ended():  # once more: a rank that completed its collectives and exited while it was read
            return False
        if self.exchange is not None:  # no shared run directory: the other nodes judge their own ranks
            self.exchange.local_states = {r: e.to_dict(timeout) for r, e in evidence.items() if r in pids}
            for rank, (published, doc) in self.exchange.remote.items():
                if rank not in pids and time.time() - published < max(10.0, timeout / 2):
                    evidence[rank] = RankEvidence.from_dict(rank, doc, age=time.time() - published)
        if status.idle_seconds < status.limit:
            return False
        judgement = self._judgement = judge(
            list(evidence.values()), timeout, status.idle_seconds, world=range(self.control.world_size() or 0)
        )
        status.busy = None if judgement.proven else judgement.line
        if judgement.proven:
            return True
        if judgement.states and all(s == RankState.DEAD for s in judgement.states.values()):
            status.busy = None
            return False  # every rank has ended; the launcher has yet to: its teardown, not a silence
        self._record_busy(judgement, status)
        limit = self.config.max_busy
        if limit is not None and status.idle_seconds >= limit:
            judgement.line = f"--max-busy {limit:g} s ran out while {judgement.line}"
            self._trigger = "max-busy"
            return True
        if self._peer_hang():
            judgement.line = f"another node of this job proved a hang; here: {judgement.line}"
            self._trigger = "peer"
            return True
        self.observer.busy(judgement)
        return False

    def _silence_ended(self) -> bool:
        """The traces read again: collectives moved since this silence began (it is over)."""
        self.tracker.poll()
        return self.tracker.last_progress() != self._silence_of

    def _evidence(self, rank: int, t: RankProgress, pids: Mapping[int, int]) -> RankEvidence:
        pending = None
        if t.last is not None and not t.last_completed:
            e = t.last
            site = f"{os.path.basename(e.call_site.file)}:{e.call_site.line}" if e.call_site else None
            pending = Pending(e.group.name, e.seq, e.op, tuple(e.group.ranks), site)
        if rank not in pids:  # another host: only its trace speaks for it here
            return RankEvidence(rank, alive=None, pending=pending, completion_tracked=t.pending_tracked)
        pid = pids[rank]
        state = procs.process_state(pid, readings=3, interval=0.02)
        if state.state in "ZX?":  # exited (a zombie not reaped yet) or gone
            return RankEvidence(rank, alive=False, pending=pending)
        dump = self._stacks.get(rank)
        ev = self.activity.evidence(
            rank, dump, alive=True, frozen=state.frozen, pending=pending, completion_tracked=t.pending_tracked
        )
        timeout = self.config.hang_timeout
        if ev.stack_stable and ev.stack_wait is None and ev.quiet_s is not None and ev.quiet_s < timeout:
            # CPU at one unchanging stack: real work in one long call, or a spin in a device
            # synchronize (a rank blocked on its GPU). The native stack tells, once per stack.
            key = (rank, dump.main_thread if dump is not None else ())
            if key not in self._device_waits:
                self._device_waits[key] = device_wait(pid, self.py_spy)
            found = self._device_waits[key]
            if found:  # spinning in a device synchronize: its CPU is no progress
                ev = replace(ev, quiet_s=self.activity.quiet(rank, cpu=False), where=f"{ev.where or '?'} [{found}]")
            elif found is None and (self.activity.quiet(rank, cpu=False) or 0.0) >= timeout:
                ev = replace(ev, quiet_s=None)  # CPU at one stack, native stack unreadable: progress unknown
        return ev

    def _peer_hang(self) -> bool:
        """Another node of this job, sharing the run directory, recorded a proven hang."""
        return any(
            name != self.node.node
            and node.get(NodeKey.HANG)
            and (node[NodeKey.HANG].get("trigger") or "hang") != "no-trace"
            for name, node in read_nodes(self.dir.manifest).items()
        )

    def _record_busy(self, judgement: Judgement, status: RunStatus) -> None:
        """Keep a silence that is no proven hang in the manifest (written at most every 5 s)."""
        start = time.time() - status.idle_seconds
        record = BusyRecord(
            start=round(start, 3),
            seconds=round(status.idle_seconds, 1),
            kind=judgement.kind.value,
            line=judgement.line,
            states={str(r): s.value for r, s in sorted(judgement.states.items())},
        )
        current = self.node.busy[-1] if self.node.busy else None
        if current is not None and not current.ended and abs(current.start - record.start) < 1.0:
            self.node.busy[-1] = record
        elif len(self.node.busy) < 100:
            self.node.busy.append(record)
        if time.monotonic() - self._busy_written >= 5.0 or current is None or current.kind != record.kind:
            self._busy_written = time.monotonic()
            self._write_manifest()

    def _close_busy(self) -> None:
        if self.node.busy and not self.node.busy[-1].ended:
            self.node.busy[-1].ended = True
            self._write_manifest()

    def _ended(self, code: int, hang: HangRecord | None) -> RunResult:
        if self.control.leftovers():
            self.control.stop()  # the launcher is gone but left workers behind: they must not outlive us
        self.tracker.poll()
        if (
            hang is None
            and self.node.hang is not None
            and self.node.hang.trigger == "no-trace"
            and self.tracker.last_progress() is not None
        ):
            self.node.hang = None  # a slow start, diagnosed early, that went on to record: not a hang
        exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as shells say
        self._finish(Status.HANG if hang else Status.FINISHED, code, hang)
        return RunResult(Outcome.HANG if hang else Outcome.FINISHED, exit_code, code, self.dir, hang, self._coverage())

    # -- moedoctor's own trouble: never the job's ------------------------------------------------

    def _check_recording(self) -> None:
        """Say once per rank that its recorder stopped (its status file says so), and note it."""
        for rank, line in sorted(self.tracker.stopped.items()):
            if line in self.node.recording_stopped:
                continue
            self.node.recording_stopped.append(line)
            if self.silence is None:
                self.silence = (
                    f"rank {rank} stopped recording: from then on, no hang is declared from the traces' silence"
                )
            self.observer.recording_stopped(line)
            self._write_manifest()

    def _silence_explained(self) -> bool:
        """The traces are silent because the ranks cannot write them, not because the job hangs: a
        rank's recorder stopped on a failed write, or the run directory's file system is read-only or
        full (a rank that could not even write its status says so on its stderr only)."""
        if self.silence is not None:
            return True
        full = _file_system_trouble(self.dir.traces)
        if full is not None:
            self.silence = full
            self._write_failed(f"{full}: the ranks cannot record, so no hang is declared from the traces' silence")
        return self.silence is not None

    def _write_failed(self, line: str) -> None:
        """One of moedoctor's own writes failed: say it once, note it, go on."""
        if line in self._said:
            return
        self._said.add(line)
        if len(self.node.write_errors) < 100:
            self.node.write_errors.append(line)
        try:
            self.observer.write_failed(line)
        except Exception:  # noqa: BLE001 - a closed terminal: the manifest still has it
            pass

    # -- what the watchdog sees ------------------------------------------------------------------

    def _status(self, now: float) -> RunStatus:
        last = self.tracker.last_progress()
        idle = now - (last if last is not None else self.control.started)
        limit = (
            self.config.hang_timeout if last is not None else max(self.config.hang_timeout, self.config.startup_timeout)
        )
        traced, stopped = self.tracker.ranks, self.tracker.stopped
        ranks = []
        seen = self.control.seen
        for rank in sorted(set(traced) | set(seen)):
            t = traced.get(rank)
            if t is None:
                ranks.append(RankStatus(rank, seen[rank].pid, None, False, None, rank in stopped))
            else:
                ranks.append(
                    RankStatus(
                        rank,
                        t.pid,
                        t.last,
                        t.last_completed,
                        now - t.last_progress,
                        rank in stopped,
                        t.storm.line(),
                        t.storm.seconds,
                    )
                )
        return RunStatus(now - self.control.started, idle, limit, ranks)

    # -- a hang ----------------------------------------------------------------------------------

    def _report_lags(self, now: float) -> None:
        stopped = self.tracker.stopped  # an unrecorded rank only looks behind
        lags = self.detector.check_lags({r: p for r, p in self.tracker.ranks.items() if r not in stopped}, now)
        if self.exchange is not None:  # lags the coordinator saw across nodes (the same once only)
            lags += [lag for lag in self.exchange.take_lags() if lag.line() not in self.node.lags]
        for lag in lags:
            if len(self.node.lags) < 100:
                self.node.lags.append(lag.line())
            self.observer.lag_detected(lag)
        if lags:
            self._write_manifest()

    def _diagnose(
        self,
        status: RunStatus,
        desync: Desync | None = None,
        no_trace: bool = False,
        judgement: Judgement | None = None,
    ) -> HangRecord:
        """Ask the ranks for coverage records, dump stacks and the GPUs in parallel, and return
        the hang as recorded in the manifest. ``desync``: declared by the online detector, not by
        the hang timeout. ``no_trace``: no rank has a trace after ``--hang-timeout``; diagnosed from
        the stacks, the job left running until the startup timeout. ``judgement``: the proof of a
        hang (or the account when ``--max-busy`` ran out), recorded as the hang's ``proof``."""
        if desync is not None:
            self.observer.desync_detected(desync, status)
        else:
            self.observer.hang_detected(status, judgement.line if judgement is not None else None)
        requested = self.evidence.request_snapshot()
        local = self.control.local_ranks()  # ours, under the launcher or not (its marker)
        self.control.seen.update(local)
        targets = {rank: p.pid for rank, p in local.items()}
        dumps, gpu_file = self.evidence.stacks_and_gpus(targets)
        # A desync is already proven by the traces: the coverage records are wanted, not worth a second.
        if not no_trace:  # no recorder has a trace to answer with
            self.evidence.await_coverage(requested, self.config.coverage_wait / 2 if desync is not None else None)
        hang = HangRecord(
            detected_at=requested,
            host=self.config.host,
            hang_timeout=self.config.hang_timeout,
            idle_seconds=round(status.idle_seconds, 1),
            stopped=not (self.config.keep_alive or no_trace),
            gpu_file=str(gpu_file) if gpu_file is not None else None,
            lags=list(self.node.lags),
        )
        found = desync or (self.detector.desync if self.detector is not None else None)
        if found is not None:
            hang.finding = found.line()
            hang.detection_latency_s = round(found.latency, 3)
            hang.mechanism = found.mechanism
        if desync is not None:
            hang.trigger = "desync"
        elif no_trace:
            hang.trigger = "no-trace"
            hang.finding = self.evidence.why_no_trace(sorted(targets))
        elif judgement is not None:
            hang.proof = judgement.line
            if judgement.kind != Silence.HANG:
                hang.trigger = self._trigger
        by_rank = {d.rank: d for d in dumps}
        now = time.monotonic()
        for rank in sorted(set(self.tracker.ranks) | set(targets)):
            hang.ranks.append(
                self.evidence.rank_at_hang(
                    rank, self.tracker.ranks.get(rank), targets.get(rank), by_rank.get(rank), now
                )
            )
        if not no_trace:
            self.node.status = Status.HANG
        self.node.hang = hang
        self._write_manifest(coverage=self._coverage())
        if not no_trace:
            self._await_peers()
        self.observer.diagnosed(hang)
        return hang

    def _await_peers(self) -> None:
        """A shared run directory: wait (``peer_wait`` at most) until every other node still running
        there has recorded its own hang (its ranks' stacks), so that the report shows every node."""
        deadline = time.monotonic() + self.config.peer_wait
        while True:
            pending = [
                name
                for name, node in read_nodes(self.dir.manifest).items()
                if name != self.node.node and node.get(NodeKey.STATUS) == Status.RUNNING and not node.get(NodeKey.HANG)
            ]
            if not pending or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def _startup_quiet(self) -> bool:
        """--hang-timeout has passed since the last rank's recorder loaded, every rank process of this
        node having loaded one. Before that, some ranks may still be importing torch (slow on a busy
        node) while the others wait for them: only the startup timeout applies then."""
        loaded = recorder_markers(self.dir.control)
        local = self.control.local_ranks()
        if not loaded or any(rank not in loaded for rank in local):
            return False
        return time.time() - max(loaded.values()) >= self.config.hang_timeout

    # -- the record ------------------------------------------------------------------------------

    def _coverage(self) -> CoverageCheck:
        self.tracker.poll()
        return coverage_check(self.tracker.ranks, self.control.world_size())

    def _finish(self, status: str, launcher_exit: int | None, hang: HangRecord | None = None) -> None:
        self.node.status = status
        self.node.end = time.time()
        self.node.launcher_exit = launcher_exit
        self.node.hang = hang or self.node.hang
        self.node.ranks = self.control.rank_exits(launcher_exit, self.node.log)
        self._write_manifest(coverage=self._coverage())

    def _write_manifest(self, coverage: CoverageCheck | None = None) -> None:
        """Merge this node's entry into the manifest; a failed write is reported, never fatal."""
        hosts = sorted({t.host for t in self.tracker.ranks.values()})
        try:
            write_node(
                self.dir.manifest,
                self.node,
                command=list(self.config.command),
                versions=_versions() | {Key.RECORDER: self.config.recorder, Key.FIXES: list(self.config.fixes)},
                world_size=self.control.world_size(),
                hosts=hosts,
                coverage=coverage,
                trace_problems=self.tracker.problems + [p for t in self.tracker.ranks.values() for p in t.problems],
            )
        except OSError as e:
            self._write_failed(cannot_write(self.dir.manifest, e, "it is rewritten at the next change"))


def _file_system_trouble(path: Path) -> str | None:
    """``the run directory's file system is read-only`` / ``... is full (0 bytes free)``, or None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return f"the run directory's file system is read-only ({path})"
    if st.f_blocks and st.f_bavail == 0:
        return f"the run directory's file system is full (0 bytes free at {path})"
    return None


class _JobLog:
    """The job's output copied to ``job.log``, unbuffered. A failed write (disk full) is reported
    once and the copy stops; the output still reaches the screen, and the job's pipes are drained."""

    def __init__(self, path: Path, failed):
        self.path, self.failed = path, failed
        try:
            self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self.fd = None
            failed(cannot_write(path, e, "the job's output goes to the screen only"))

    def write(self, data: bytes) -> None:
        if self.fd is None:
            return
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError as e:
            self.failed(cannot_write(self.path, e, "the job's output goes to the screen only from here"))
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "_JobLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
