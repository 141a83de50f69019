"""Which recorder a run's ranks use: the native C++ kernel (about 3-5 us per collective) or the
Python kernels (tens of us). The native kernel is built here, in the supervisor, once per environment
(about 40 s, said on the screen; cached in torch's extension folder), so that the ranks only load it."""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("auto", "native", "python")


@dataclass(frozen=True)
class RecorderChoice:
    kind: str  # "native" or "python"
    note: str  # why, for the user and the manifest


def choose_recorder(requested: str, announce=lambda message: None) -> RecorderChoice:
    """Resolve ``auto`` / ``native`` / ``python``. ``native`` that cannot be built raises
    ``MoedoctorError``; ``auto`` then falls back to Python and says why."""
    from moedoctor.errors import EXIT_USAGE, MoedoctorError

    if requested not in CHOICES:
        raise MoedoctorError(f"--recorder must be one of {', '.join(CHOICES)}, not {requested!r}", EXIT_USAGE)
    if requested == "python":
        return RecorderChoice("python", "requested")
    from moedoctor.recorder import native

    if native.available(announce):
        return RecorderChoice("native", "built" if requested == "auto" else "requested")
    if requested == "native":
        raise MoedoctorError(f"the native recorder cannot be built: {native.reason}", EXIT_USAGE)
    why = native.reason.splitlines()[-1] if native.reason else "?"
    return RecorderChoice("python", f"native recorder unavailable: {why}")
