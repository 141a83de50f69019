"""The environment contract: every ``MOEDOCTOR_*`` variable, who sets it, who reads it, what it means.

The one place these names are spelled (``tests/unit/test_owners.py`` fails on a ``MOEDOCTOR_*`` name
anywhere else in the package); writers and readers go through the ``Var`` objects and the typed
readers below. A shared leaf: it imports only ``os`` (the bootstrap imports it in every process of
the job, before torch), so the recorder, the fixes, the runner, triage and the analysis all may.

============================ ===================== ===============================================================
variable                     set by                meaning
============================ ===================== ===============================================================
``MOEDOCTOR_RUN_DIR``        ``moedoctor run``     the run directory: set, the bootstrap installs the recorder
``MOEDOCTOR_LAUNCH_ID``      ``moedoctor run``     marks every process of one launch (orphans are found by it)
``MOEDOCTOR_MAX_EVENTS``     ``--max-events``      stop recording a rank's collectives after N (default 2,000,000)
``MOEDOCTOR_NATIVE``         ``--recorder``        ``1``: the native (C++) recording kernel; else Python
``MOEDOCTOR_NATIVE_VERBOSE`` the user              ``1``: the native kernel's build prints its compiler output
``MOEDOCTOR_FAST_WALK``      the user              ``0``: the native kernel never walks CPython's frames directly
``MOEDOCTOR_SITE_CACHE``     the user              ``0``: the native kernel walks the whole stack at every collective
``MOEDOCTOR_DEFER_FORMAT``   the user              ``0``: the native kernel formats each record on the training thread
``MOEDOCTOR_GIL_FREE``       the user              ``0``: the native kernel takes the GIL at every collective
``MOEDOCTOR_FR_COMPLETION``  the user              ``0``: no completion records from the Flight Recorder poller
``MOEDOCTOR_CHECK_PARAMS``   ``--check-params``    the optimizer step whose parameters are fingerprinted
``MOEDOCTOR_FIXES``          ``verify``, ``--fix`` comma-separated fix names the workers install
``MOEDOCTOR_FIX_CONFIG``     ``verify``, ``--fix`` a JSON file: {fix name: normalized ``--config`` section}
``MOEDOCTOR_FIX_CHECKS``     ``verify``            ``1``: run the fixes' numerical checks
``MOEDOCTOR_DEBUG``          the user              set: moedoctor's own errors print their traceback
============================ ===================== ===============================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: What every variable of the contract starts with (``launchers.moedoctor_env`` forwards them all).
PREFIX = "MOEDOCTOR_"

Environ = Mapping[str, str]


class Var:
    """One variable of the contract: its name and what it means."""

    __slots__ = ("name", "meaning")

    def __init__(self, suffix: str, meaning: str) -> None:
        self.name = PREFIX + suffix
        self.meaning = meaning

    def __repr__(self) -> str:
        return f"Var({self.name})"

    def get(self, environ: Environ | None = None, default: str | None = None) -> str | None:
        """The raw value (``default`` when unset)."""
        return (os.environ if environ is None else environ).get(self.name, default)

    def is_set(self, environ: Environ | None = None) -> bool:
        """Set to a non-empty value."""
        return bool(self.get(environ))

    def equals(self, value: str, environ: Environ | None = None, default: str = "") -> bool:
        return self.get(environ, default) == value


RUN_DIR = Var("RUN_DIR", "the run directory of the job (set: the bootstrap installs the recorder)")
LAUNCH_ID = Var("LAUNCH_ID", "marks every process of one launch, so orphans of a dead launcher are found")
MAX_EVENTS = Var("MAX_EVENTS", "stop recording a rank's collectives after this many events")
NATIVE = Var("NATIVE", "'1': record with the native (C++) kernel; anything else: the Python kernels")
NATIVE_VERBOSE = Var("NATIVE_VERBOSE", "'1': the native kernel's build prints the compiler's output")
FAST_WALK = Var("FAST_WALK", "'0': the native kernel never walks CPython's frames directly")
SITE_CACHE = Var("SITE_CACHE", "'0': the native kernel walks the whole stack at every collective (no call-site cache)")
DEFER_FORMAT = Var("DEFER_FORMAT", "'0': the native kernel formats each record on the recording thread")
GIL_FREE = Var("GIL_FREE", "'0': the native kernel takes the GIL at every collective, call-site cache hits included")
FR_COMPLETION = Var("FR_COMPLETION", "'0': no completion records from the Flight Recorder poller")
CHECK_PARAMS = Var("CHECK_PARAMS", "the optimizer step whose parameters are fingerprinted (--check-params)")
FIXES = Var("FIXES", "comma-separated names of the fixes the workers install")
FIX_CONFIG = Var("FIX_CONFIG", "a JSON file: {fix name: normalized --config section}")
FIX_CHECKS = Var("FIX_CHECKS", "'1': run the fixes' numerical checks (moedoctor verify)")
DEBUG = Var("DEBUG", "set: moedoctor's own errors print their traceback")

#: The whole contract, in the order of the table above.
VARIABLES = (
    RUN_DIR,
    LAUNCH_ID,
    MAX_EVENTS,
    NATIVE,
    NATIVE_VERBOSE,
    FAST_WALK,
    SITE_CACHE,
    DEFER_FORMAT,
    GIL_FREE,
    FR_COMPLETION,
    CHECK_PARAMS,
    FIXES,
    FIX_CONFIG,
    FIX_CHECKS,
    DEBUG,
)
#: Set by ``moedoctor run`` for one run only: removed from the job's environment before it is set again.
FIX_VARIABLES = (FIXES, FIX_CONFIG, FIX_CHECKS)


#: ``MOEDOCTOR_MAX_EVENTS``'s default: the recorder stops recording a rank's collectives after this many
#: (``moedoctor run --max-events``; the coverage check then reports the drop).
DEFAULT_MAX_EVENTS = 2_000_000


# ---- typed readers ----------------------------------------------------------------------------------


def run_dir(environ: Environ | None = None) -> str | None:
    """The run directory (None outside ``moedoctor run``, or when set empty)."""
    return RUN_DIR.get(environ) or None


def max_events(environ: Environ | None = None, default: int = 0) -> int:
    """``MOEDOCTOR_MAX_EVENTS`` as an int (``default`` when unset); ValueError when malformed."""
    raw = MAX_EVENTS.get(environ)
    return default if raw is None else int(raw)


def native_requested(environ: Environ | None = None) -> bool:
    return NATIVE.equals("1", environ)


def native_verbose(environ: Environ | None = None) -> bool:
    return NATIVE_VERBOSE.equals("1", environ)


def fast_walk(environ: Environ | None = None) -> bool:
    """On unless ``MOEDOCTOR_FAST_WALK=0``."""
    return not FAST_WALK.equals("0", environ, "1")


def site_cache(environ: Environ | None = None) -> bool:
    """On unless ``MOEDOCTOR_SITE_CACHE=0``."""
    return not SITE_CACHE.equals("0", environ, "1")


def defer_format(environ: Environ | None = None) -> bool:
    """On unless ``MOEDOCTOR_DEFER_FORMAT=0``."""
    return not DEFER_FORMAT.equals("0", environ, "1")


def gil_free(environ: Environ | None = None) -> bool:
    """On unless ``MOEDOCTOR_GIL_FREE=0``."""
    return not GIL_FREE.equals("0", environ, "1")


def fr_completion(environ: Environ | None = None) -> bool:
    """On unless ``MOEDOCTOR_FR_COMPLETION=0``."""
    return not FR_COMPLETION.equals("0", environ, "1")


def check_params_step(environ: Environ | None = None) -> int | None:
    """The step of ``--check-params`` (None when unset or empty); ValueError when malformed."""
    raw = CHECK_PARAMS.get(environ)
    return int(raw) if raw else None


def fixes(environ: Environ | None = None) -> list[str]:
    """The fix names in ``MOEDOCTOR_FIXES`` (empty when unset)."""
    return [n for n in (FIXES.get(environ) or "").split(",") if n]


def fix_config(environ: Environ | None = None) -> str | None:
    return FIX_CONFIG.get(environ)


def fix_checks(environ: Environ | None = None) -> bool:
    return FIX_CHECKS.equals("1", environ)


def debug(environ: Environ | None = None) -> bool:
    return DEBUG.is_set(environ)


def ours(environ: Environ) -> dict[str, str]:
    """Every ``MOEDOCTOR_*`` variable of ``environ`` (the contract's and any other of the prefix)."""
    return {k: v for k, v in environ.items() if k.startswith(PREFIX)}
