"""Record an exception that nothing caught, in this rank's trace (the ``x`` record).

``install`` chains a hook in front of ``sys.excepthook`` and ``threading.excepthook``: the hook
writes one record (the exception's class with its module, its message, the traceback's frames, the
thread, the phase and step) through the trace writer, which flushes the native kernel's buffer first
and writes with one ``os.write``, then hands the exception to the hook that was there before (which
prints it as usual). Nothing here runs on the collective path; a failure of the hook is swallowed,
so the job's own exception is always printed.

When the traceback passes through ``torch.utils.checkpoint`` with its ``_CheckpointFrame`` at hand
(the unpack hook that recomputes, the check that compares what forward and recompute saved), the
record also names the function it checkpointed, read from that frame's ``recompute_fn``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import types

from moedoctor.events import Phase
from moedoctor.trace import schema
from moedoctor.trace.schema import MAX_FRAMES, MAX_FRAMES_OUTER, MAX_MESSAGE, MAX_STRING

_TORCH_DIR = os.sep + "torch" + os.sep


def install(recorder) -> None:
    """Chain the hooks once per process (an installed hook is marked and not wrapped again)."""
    previous = sys.excepthook
    if not getattr(previous, "__moedoctor__", False):

        def excepthook(exc_type, exc, tb):
            _record(recorder, exc_type, exc, tb, threading.current_thread().name)
            previous(exc_type, exc, tb)

        excepthook.__moedoctor__ = True  # type: ignore[attr-defined]
        sys.excepthook = excepthook

    previous_thread = threading.excepthook
    if not getattr(previous_thread, "__moedoctor__", False):

        def thread_excepthook(args):
            if args.exc_type is not SystemExit:
                name = args.thread.name if args.thread is not None else threading.current_thread().name
                _record(recorder, args.exc_type, args.exc_value, args.exc_traceback, name)
            previous_thread(args)

        thread_excepthook.__moedoctor__ = True  # type: ignore[attr-defined]
        threading.excepthook = thread_excepthook


def _record(recorder, exc_type, exc, tb, thread: str) -> None:
    try:
        if recorder.paused or not recorder.is_open:
            return
        recorder.write_record(exception_record(exc_type, exc, tb, thread, recorder.step, recorder.checkpoint))
    except Exception:  # noqa: BLE001 - the job's exception must be printed whatever happens here
        pass


def exception_record(exc_type, exc, tb, thread: str, step: int, checkpoint_phase: Phase | None = None) -> dict:
    """The ``x`` record of one exception, in the schema's key order."""
    tb_frames = list(_walk(tb))
    frames = [[_bounded(f.f_code.co_filename), lineno, _bounded(f.f_code.co_name)] for f, lineno in tb_frames]
    cut = 0
    if len(frames) > MAX_FRAMES:
        cut = len(frames) - MAX_FRAMES
        frames = frames[:MAX_FRAMES_OUTER] + frames[-(MAX_FRAMES - MAX_FRAMES_OUTER) :]
    return schema.fields(
        schema.EXCEPTION,
        time=time.time(),
        type=_bounded(_qualified(exc_type)),
        message=_message(exc),
        frames=frames,
        frames_left_out=cut or None,
        thread=_bounded(thread),
        phase=(checkpoint_phase or _phase(tb_frames)).value,
        step=step,
        checkpointed=_checkpointed(tb_frames),
    )


def _walk(tb):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_STRING else text[: MAX_STRING - 3] + "..."


def _qualified(exc_type) -> str:
    module = getattr(exc_type, "__module__", None) or ""
    name = getattr(exc_type, "__qualname__", None) or getattr(exc_type, "__name__", "?")
    return name if module in ("", "builtins") else f"{module}.{name}"


def _message(exc) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        text = f"<{type(exc).__name__} whose str() failed>"
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _in_torch(frame, *parts: str) -> bool:
    path = frame.f_code.co_filename
    return _TORCH_DIR in path and path.replace(os.sep, "/").endswith("/".join(parts))


def _phase(tb_frames) -> Phase:
    """Backward when autograd's engine is anywhere in the traceback (a checkpointed region's
    recompute, module calls and all, is part of backward); else the innermost of an optimizer's
    step or a module's call (forward); else ``other``."""
    for frame, _ in tb_frames:
        name = frame.f_code.co_name
        if _in_torch(frame, "autograd/graph.py") and name == "_engine_run_backward":
            return Phase.BACKWARD
        if _in_torch(frame, "autograd/__init__.py") and name in ("backward", "grad"):
            return Phase.BACKWARD
    for frame, _ in reversed(tb_frames):
        name = frame.f_code.co_name
        if _in_torch(frame, "optim/optimizer.py") and name in ("wrapper", "_use_grad"):
            return Phase.OPTIMIZER
        if _in_torch(frame, "nn/modules/module.py") and name in ("_call_impl", "_wrapped_call_impl"):
            return Phase.FORWARD
    return Phase.OTHER


def _checkpointed(tb_frames) -> list | None:
    """``[function, file, line, module class, module lists]`` of the function ``torch.utils.checkpoint`` was running,
    read from a ``_CheckpointFrame`` among the locals of a frame of ``torch/utils/checkpoint.py``."""
    module = sys.modules.get("torch.utils.checkpoint")
    frame_class = getattr(module, "_CheckpointFrame", None)
    if frame_class is None:
        return None
    for frame, _ in reversed(tb_frames):
        if not _in_torch(frame, "utils/checkpoint.py"):
            continue
        for value in list(frame.f_locals.values()):
            if isinstance(value, frame_class):
                fn = _closure_value(getattr(value, "recompute_fn", None), "fn")
                if fn is not None:
                    return _describe(fn)
    return None


def _closure_value(function, name: str):
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is None or closure is None or name not in code.co_freevars:
        return None
    try:
        return closure[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _describe(fn) -> list | None:
    """``[qualified name, file, first line, module class, module lists]`` of a checkpointed callable: a module
    (its ``forward``), a bound method of a module, a ``functools.partial``, a plain function."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:
            break
    owner = getattr(fn, "__self__", None)
    function = getattr(fn, "__func__", fn)
    if not isinstance(function, (types.FunctionType, types.MethodType)) and callable(fn) and owner is None:
        owner, function = fn, getattr(type(fn), "forward", None) or type(fn).__call__
    code = getattr(function, "__code__", None)
    in_module_py = code is not None and code.co_filename.replace(os.sep, "/").endswith("nn/modules/module.py")
    if owner is not None and in_module_py:
        function = getattr(type(owner), "forward", function)  # ``module.__call__``: name its forward
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    owner_class = "" if owner is None or isinstance(owner, type) else type(owner).__name__
    name = getattr(function, "__qualname__", code.co_name)
    return [
        _bounded(name),
        _bounded(code.co_filename),
        code.co_firstlineno,
        _bounded(owner_class),
        _module_lists(owner),
    ]


def _module_lists(owner) -> list[str]:
    """``name:count`` of each ``nn.ModuleList`` inside ``owner`` whose members (2 or more) share one
    class, and ``name.{p,q}:count`` of each module holding its members stacked: 2 or more parameters
    of its own of 3 or more dimensions sharing a leading one of 2 or more (fused experts, ``w1[e]``);
    at most ``MAX_FRAMES``."""
    try:
        from torch import nn

        if not isinstance(owner, nn.Module):
            return []
        found = []
        for name, module in owner.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
                found.append(_bounded(f"{name}:{len(module)}"))
            else:
                stacked: dict[int, list[str]] = {}
                for pname, param in module.named_parameters(recurse=False):
                    if param.dim() >= 3 and param.shape[0] >= 2:
                        stacked.setdefault(int(param.shape[0]), []).append(pname)
                for lead, pnames in stacked.items():
                    if len(pnames) >= 2:
                        found.append(_bounded(f"{name + '.' if name else ''}{{{','.join(pnames)}}}:{lead}"))
            if len(found) >= MAX_FRAMES:
                break
        return found[:MAX_FRAMES]
    except Exception:  # noqa: BLE001 - a module whose traversal fails: no lists named
        return []
