"""A process's scheduler state as read from ``/proc``: a typed record shared by the runner, which
reads it at a hang, and the analysis, which reports a rank that does not run. Nothing here reads
``/proc`` or imports torch (``moedoctor.runner.procs.process_state`` takes the readings)."""

from __future__ import annotations

from dataclasses import dataclass

#: Process states in which the process does not run at all, and what each means.
FROZEN_STATES = {
    "T": "stopped (state T: a SIGSTOP, a job-control stop, or a debugger holds it)",
    "t": "stopped by a tracer (state t: a debugger holds it)",
    "D": "in uninterruptible sleep (state D: stuck in a kernel or driver call)",
}


#: Every state letter Linux shows in /proc/PID/stat, and "?" for a process gone.
_STATE_LETTERS = frozenset("RSDTtZXxKWPI?")


@dataclass(frozen=True, slots=True)
class ProcessState:
    """A process's scheduler state, read from ``/proc/PID/stat`` (the main thread's) a few times
    around a stack dump, and its ``wchan`` (the kernel function it sleeps in, where readable).

    ``samples`` holds one letter per reading, in order (``R`` running, ``S`` sleeping, ``D``
    uninterruptible, ``T`` stopped, ``t`` traced, ``Z`` zombie, ``?`` gone). A process counts as
    not running only when every reading agrees: a process passes through ``D`` for a moment on
    every page fault or disk read."""

    samples: str
    wchan: str | None = None
    seconds: float = 0.0  # from the first reading to the last

    @property
    def state(self) -> str:
        return self.samples[:1] or "?"

    @property
    def frozen(self) -> str | None:
        """``T``, ``t`` or ``D`` when every reading says the process does not run (``T`` for a mix
        of ``T`` and ``t``: stopped either way), else None."""
        s = self.samples
        if not s:
            return None
        if all(c in "Tt" for c in s):
            return "T" if "T" in s else "t"
        if all(c == "D" for c in s):
            return "D"
        return None

    @property
    def summary(self) -> str:
        """One word for a report: the frozen letter, the state when every reading agrees, else the
        readings (``SDS``)."""
        return self.frozen or (self.state if len(set(self.samples)) <= 1 else self.samples)

    def describe(self) -> str:
        """``stopped (state T: ...; wchan do_signal_stop; 4 readings over 0.2 s)``."""
        frozen = self.frozen
        what = FROZEN_STATES[frozen] if frozen else f"state {self.state}"
        extra = [f"wchan {self.wchan}"] if self.wchan else []
        if len(self.samples) > 1:
            extra.append(f"{len(self.samples)} readings over {self.seconds:.1f} s: {self.samples}")
        return what + (f" ({'; '.join(extra)})" if extra and frozen else "")

    def to_dict(self) -> dict:
        return {"state": self.state, "samples": self.samples, "wchan": self.wchan, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, raw: dict) -> ProcessState:
        """Parse ``to_dict``'s form; ValueError on anything else (a damaged record)."""
        samples = raw.get("samples") or raw.get("state")
        wchan = raw.get("wchan")
        seconds = raw.get("seconds") or 0.0
        if (
            not isinstance(samples, str)
            or not samples
            or set(samples) - _STATE_LETTERS
            or not isinstance(wchan, (str, type(None)))
            or not isinstance(seconds, (int, float))
        ):
            raise ValueError(f"not a process state record: {raw!r:.80}")
        return cls(samples=samples, wchan=wchan or None, seconds=float(seconds))
