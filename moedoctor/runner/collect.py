"""Collecting the evidence of a hang, for ``run_job``: the ranks' coverage records (asked through the
run directory's snapshot request), their stacks (py-spy) and process states, the GPUs (NVML), each
rank's last collective as the hang record keeps it, and why no rank has a trace yet."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from moedoctor.errors import cannot_write
from moedoctor.run_records import LastCollective, RankAtHang
from moedoctor.runner.gpu import write_gpu_snapshot
from moedoctor.runner.progress import ProgressTracker, RankProgress
from moedoctor.runner.rundir import RunDir
from moedoctor.runner.stacks import StackDump, StackTarget, dump_stacks
from moedoctor.trace.format import recorder_markers

if TYPE_CHECKING:
    from moedoctor.runner.launch import RunConfig


class HangEvidence:
    """What the supervisor gathers about the ranks when it declares a hang (or is interrupted)."""

    def __init__(
        self, config: RunConfig, run_dir: RunDir, tracker: ProgressTracker, write_failed: Callable[[str], None]
    ):
        self.config = config
        self.dir = run_dir
        self.tracker = tracker
        self.write_failed = write_failed

    def request_snapshot(self) -> float:
        """Ask every rank for a coverage record; the request's time (now, if it cannot be written)."""
        try:
            return self.dir.request_snapshot()
        except OSError as e:
            self.write_failed(
                cannot_write(self.dir.snapshot_request, e, "the ranks' coverage records are not asked for")
            )
            return time.time()

    def stacks_and_gpus(self, targets: dict[int, int]) -> tuple[list[StackDump], Path | None]:
        """Dump the stacks of ``targets`` (rank -> pid) and the GPUs, in parallel."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            gpu = pool.submit(self.gpu_snapshot)
            # Each rank's process state (/proc) is recorded with or without its stack (--no-stacks):
            # a stopped rank is a fact the analysis needs; py-spy never attaches to one.
            dumps: list[StackDump] = dump_stacks(
                [StackTarget(r, p) for r, p in sorted(targets.items())],
                self.dir.stacks,
                self.config.host,
                self.config.native,
                py_spy=self.config.stacks,
            )
            gpu_file = gpu.result()
        for dump in dumps:
            if dump.write_error:
                self.write_failed(dump.write_error)
        return dumps, gpu_file

    def gpu_snapshot(self) -> Path | None:
        try:
            return write_gpu_snapshot(self.dir.gpu, self.config.host)
        except OSError as e:
            self.write_failed(cannot_write(self.dir.gpu_file(self.config.host), e))
            return None

    def last_coverage(self) -> None:
        """Before stopping an interrupted job: its ranks' coverage records, if they come quickly."""
        try:
            self.await_coverage(self.dir.request_snapshot())
        except (KeyboardInterrupt, OSError):
            pass  # a second Ctrl-C: stop at once

    def await_coverage(self, requested: float, wait: float | None = None) -> None:
        """Wait until ``coverage_wait`` (or ``wait``) after the request for the ranks' coverage
        records, and up to a second more for ranks that have not answered yet."""
        wait = self.config.coverage_wait if wait is None else wait
        soon = time.monotonic() + max(0.0, requested + wait - time.time())
        latest = soon + 1.0
        while time.monotonic() < latest:
            ranks = self.tracker.poll()
            answered = all(r.coverage is not None and r.coverage.time >= requested - 1 for r in ranks.values())
            if answered and time.monotonic() >= soon:
                return
            time.sleep(0.1)

    def rank_at_hang(
        self, rank: int, trace: RankProgress | None, pid: int | None, dump: StackDump | None, now: float
    ) -> RankAtHang:
        last = None
        if trace is not None and trace.last is not None:
            e = trace.last
            last = LastCollective(
                group=e.group.name,
                seq=e.seq,
                op=e.op,
                call_site=str(e.call_site) if e.call_site else None,
                phase=e.phase.value,
                step=e.step,
                completed=trace.last_completed,
            )
        entry = RankAtHang(
            rank=rank,
            host=trace.host if trace else self.config.host,
            pid=trace.pid if trace else pid,
            last=last,
            idle_seconds=round(now - trace.last_progress, 1) if trace else None,
        )
        if dump is not None:
            entry.stack_file = str(dump.path) if dump.path else None
            entry.stack_error = dump.error
            entry.waiting_in = str(dump.waiting_in) if dump.waiting_in else None
            entry.user_frame = str(dump.user_frame) if dump.user_frame else None
        return entry

    def why_no_trace(self, ranks: list[int]) -> str:
        """Why no rank has a trace: the recorder's install markers say whether it loaded."""
        loaded = recorder_markers(self.dir.control)
        if not ranks:
            return (
                "no rank process was found under the launcher: the job has not started its workers "
                "(rendezvous, or the launcher itself is stuck)"
            )
        if not loaded:
            return (
                f"the recorder has not loaded in any of the {len(ranks)} rank process(es): they have not imported "
                "torch yet, or moedoctor's bootstrap is not on their Python path (did the job replace PYTHONPATH, "
                "or start another interpreter?)"
            )
        missing = [r for r in ranks if r not in loaded]
        text = (
            f"the recorder is loaded in rank(s) {','.join(map(str, sorted(loaded)))}, but no rank has created "
            "its default process group yet (init_process_group / init_device_mesh not returned)"
        )
        if missing:
            text += f"; not loaded in rank(s) {','.join(map(str, missing))}"
        return text
