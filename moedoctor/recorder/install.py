"""Install the recorder in this process: kernels, evidence hooks, the exception hooks, and the trace
opened when the default process group is created (or at once if it already exists)."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from moedoctor import environment
from moedoctor.layout import RunDir

_recorder = None

ENV_RUN_DIR = environment.RUN_DIR.name
ENV_MAX_EVENTS = environment.MAX_EVENTS.name


def installed_recorder():
    return _recorder


def activate_from_env() -> None:
    """Called by the bootstrap once torch is imported in a process of a job under ``moedoctor run``."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        from moedoctor.recorder.core import DEFAULT_MAX_EVENTS

        run_dir = Path(os.environ[ENV_RUN_DIR])
        install(run_dir, environment.max_events(default=DEFAULT_MAX_EVENTS))
        if environment.CHECK_PARAMS.is_set():  # moedoctor run --check-params; nothing is hooked otherwise
            try:
                from moedoctor.recorder import params

                params.install(run_dir, environment.check_params_step() or 0)
            except Exception as e:  # the check only: the recorder is installed
                print(f"moedoctor: --check-params not installed: {e!r}", file=sys.stderr)
        if "RANK" in os.environ:
            from moedoctor.trace.format import write_recorder_marker

            try:
                write_recorder_marker(RunDir(run_dir).control, int(os.environ["RANK"]), os.getpid())
            except (OSError, ValueError):
                pass  # the marker only explains a missing trace; never fail the job over it
    except Exception as e:
        print(f"moedoctor: recorder not installed: {e!r}", file=sys.stderr)


def install(run_dir: Path, max_events: int | None = None):
    """Install the recorder once per process; returns it."""
    global _recorder
    if _recorder is not None:
        return _recorder
    import torch.distributed as dist

    from moedoctor import _process_group_hooks as process_group_hooks
    from moedoctor.recorder import evidence, exceptions
    from moedoctor.recorder.core import DEFAULT_MAX_EVENTS, Recorder

    recorder = Recorder(run_dir, max_events or DEFAULT_MAX_EVENTS)
    recorder.register_kernels()
    evidence.install(recorder)
    exceptions.install(recorder)

    # Closed before the default group is destroyed, while the groups still answer their sequence counters.
    process_group_hooks.before_destroy(lambda: recorder.close("destroy"))
    process_group_hooks.after_init(recorder.open)
    if dist.is_initialized():
        recorder.open()
    atexit.register(recorder.before_finalization)  # registered first, runs last (atexit runs them in reverse)
    atexit.register(recorder.flush)  # records buffered after close (late evidence) reach the file
    atexit.register(lambda: recorder.close("exit") if dist.is_initialized() else None)
    _flush_before_os_exit(recorder)
    _recorder = recorder
    return recorder


def _flush_before_os_exit(recorder) -> None:
    """``os._exit`` skips atexit: the native kernel's buffered records are written first."""
    original = os._exit
    if getattr(original, "__moedoctor__", False):
        return

    def _exit(status):
        try:
            recorder.flush()
        except Exception:  # noqa: BLE001 - exiting must not fail because of the recorder
            pass
        original(status)

    _exit.__moedoctor__ = True  # type: ignore[attr-defined]
    os._exit = _exit
