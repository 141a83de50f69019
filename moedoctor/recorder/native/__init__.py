"""The native recording kernel: opt-in (``MOEDOCTOR_NATIVE=1``), the Python kernels stay the fallback.

``kernel.cpp`` is the C++ twin of ``kernels.PythonKernels._kernel`` / ``_record``: a boxed kernel per
collective op at ``BackendSelect`` that records the same ``c`` line before the op is issued (its raw
fields into a slot of a pending list; the writer thread formats and writes it within 2 ms, and so do a
flush, close and the fatal-signal handler), and keeps c10d ``Work`` objects for the progress thread's
``poll()``. It is built on
first use with ``torch.utils.cpp_extension.load`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``; ranks building at once wait on torch's file lock) and needs a
C++ compiler and ``ninja``; ``python -m moedoctor.recorder.native`` builds it ahead (at install time).
The build is per environment: its folder's name (``extension_name``) digests the source, this
environment (``sys.prefix``), torch's and this source's install locations and the torch and Python
versions, so two environments (or two checkouts) never share a folder and overwrite each other's
build, which cost a silent 30-50 s rebuild at every switch. Whenever a build runs, stderr says so.
Nothing here raises into the user's job: ``available()`` says whether the kernel could be built and
loaded, ``reason`` why not.

The counters (event ids, per-group and per-peer sequence numbers, written/dropped) live in C++ while
the native kernels are registered; ``NativeKernels`` hands them over in both directions when the
kernels are switched between Python and native (benchmarks do). Cold paths call back into Python
(``_Helper``): a new code object's flags, a new call site, group or thread, the cap record, errors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

from moedoctor import environment

ENV_NATIVE = environment.NATIVE.name
_SOURCE = Path(__file__).with_name("kernel.cpp")

_module = None
_tried = False
_load_lock = threading.Lock()
reason = "not loaded yet"  # why available() is False; "" once loaded


def requested() -> bool:
    """The job asked for the native kernel (``MOEDOCTOR_NATIVE=1``)."""
    return environment.native_requested()


def available(announce=None) -> bool:
    """Build (first time) and load the extension; False, with ``reason`` set, where it cannot be.
    ``announce(message)`` is told when a build runs (default: a ``moedoctor:`` line on stderr)."""
    return load(announce) is not None


def _say(message: str) -> None:
    print(f"moedoctor: {message}", file=sys.stderr, flush=True)


def load(announce=None):
    """The extension module, or None. Never raises."""
    global _module, _tried, reason
    with _load_lock:
        if not _tried:
            _tried = True
            try:
                _module = _build(announce or _say)
                reason = ""
            except BaseException as e:  # noqa: BLE001 - a failed build must not end the job
                if isinstance(e, KeyboardInterrupt):
                    raise
                reason = f"{type(e).__name__}: {e}".strip()[-2000:]
        return _module


def built() -> bool:
    """This source is already built for this environment (loading it is then fast)."""
    try:
        return _built(extension_name())
    except Exception:
        return False


def extension_name() -> str:
    """The module's name, which names its build folder: ``build_key`` of this source, environment,
    install locations and versions (a new build per change, one per environment)."""
    import torch

    return build_key(
        _SOURCE.read_bytes() + b"\0" + _schema_header().encode(),
        prefix=sys.prefix,
        torch_dir=os.path.dirname(torch.__file__),
        source_path=str(_SOURCE),
        torch_version=torch.__version__,
        python_version=sys.version,
    )


def build_key(
    source: bytes, *, prefix: str, torch_dir: str, source_path: str, torch_version: str, python_version: str
) -> str:
    """``moedoctor_native_<digest>``: what a build depends on, and the environment it belongs to.
    Paths count resolved (a symlinked venv is one environment)."""
    parts = [
        os.path.realpath(prefix),
        os.path.realpath(torch_dir),
        os.path.realpath(source_path),
        torch_version,
        python_version,
    ]
    digest = hashlib.sha256(source + b"\0" + "\0".join(parts).encode())
    return f"moedoctor_native_{digest.hexdigest()[:12]}"


def _schema_header() -> str:
    """``moedoctor_schema.h``, the keys the kernel writes (``moedoctor.trace.schema.cpp_header``)."""
    from moedoctor.trace.schema import cpp_header

    return cpp_header()


def _write_schema_header(folder: Path) -> Path:
    """Write ``moedoctor_schema.h`` into ``folder/include`` (only when its text changed: ninja rebuilds
    on a newer header) and return that folder. Ranks building at once write the same text."""
    include = folder / "include"
    include.mkdir(parents=True, exist_ok=True)
    header = include / "moedoctor_schema.h"
    text = _schema_header()
    try:
        if header.read_text() == text:
            return include
    except OSError:
        pass
    tmp = include / f".moedoctor_schema.h.{os.getpid()}"
    tmp.write_text(text)
    tmp.replace(header)
    return include


def _build(announce):
    import torch.distributed as dist
    from torch.utils import cpp_extension

    if not dist.is_available():
        raise RuntimeError("torch was built without torch.distributed")
    if not cpp_extension.is_ninja_available():  # cpp_extension.load runs ninja even for a cached build
        raise RuntimeError("ninja is not installed (pip install ninja)")
    name = extension_name()
    compiler = os.environ.get("CXX", "c++")
    before = _library_mtime(name)
    if shutil.which(compiler) is None and before is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH")
    if before is None:
        announce("building the native recorder for this environment (first run, ~40 s)...")
    started = time.monotonic()
    folder = _folder(name)
    if folder is None:
        raise RuntimeError("torch's extension build folder is unknown (torch.utils.cpp_extension changed)")
    module = cpp_extension.load(
        name=name,
        sources=[str(_SOURCE)],
        extra_cflags=["-O2"],
        extra_include_paths=[str(_write_schema_header(folder))],
        verbose=environment.native_verbose(),
    )
    after = _library_mtime(name)
    if after != before:  # built now (or rebuilt: torch decided the inputs changed)
        announce(
            f"native recorder {'built' if before is None else 'rebuilt'} for this environment in "
            f"{time.monotonic() - started:.0f} s ({_folder(name)})"
        )
    return module


def _folder(name: str) -> Path | None:
    """The extension's build folder in torch's cache."""
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(name, verbose=False))  # private; torch >= 1.x
    except Exception:
        return None


def _library_mtime(name: str) -> int | None:
    """The built library's mtime (ns), None when it is not built."""
    folder = _folder(name)
    try:
        return None if folder is None else (folder / f"{name}.so").stat().st_mtime_ns
    except OSError:
        return None


def _built(name: str) -> bool:
    """A build of this source is in torch's extension cache already, for this environment."""
    return _library_mtime(name) is not None


# -- the Python side of the native kernel ---------------------------------------------------------


def _dtype_names(module) -> list[str]:
    """``str(dtype)`` without ``torch.``, indexed by the C++ ScalarType of each dtype."""
    import torch

    names: dict[int, str] = {}
    dtypes = {value: None for value in vars(torch).values() if isinstance(value, torch.dtype)}
    for value in dtypes:
        if str(value).startswith("torch.q"):  # quantized: no collective carries them
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                index = module.scalar_type_of(torch.empty(0, dtype=value))
        except Exception:
            continue  # dtypes no plain tensor has: collectives never see them
        names.setdefault(index, str(value).removeprefix("torch."))
    table = [""] * (max(names, default=-1) + 1)
    for index, name in names.items():
        table[index] = name
    return table


class _Helper:
    """What the C++ kernel asks Python for, on cold paths only (the GIL is held)."""

    def __init__(self, recorder) -> None:
        from moedoctor.recorder import callsite, records

        self._recorder = recorder
        self._records = records
        self.flags = callsite._flags
        self.json_str = records.json_str

    def thread_name(self) -> str:
        return self.json_str(threading.current_thread().name)

    def group(self, name: str) -> tuple[bytes, list[int]]:
        """A ``g`` record without its kind and id, and the group's global ranks."""
        ranks = self._recorder.records.ranks.of(name)
        return self._records.encode(self._records.group_fields(name, ranks)), list(ranks)

    def site(self, key: tuple) -> bytes:
        """An ``s`` record without its kind and id."""
        return self._records.encode(self._records.site_fields(key))

    def cap_record(self) -> bytes:
        return self._records.cap_line(self._recorder.max_events)

    def error(self, op: str, message: str) -> None:
        self._recorder.internal_error(op, message, native=True)


def _fast_walk(module) -> bool:
    """Switch the kernel's stack walk to CPython's own frames where, checked here once from a few
    frames deep, it sees exactly the frames and lines the frame-object walk sees
    (``MOEDOCTOR_FAST_WALK=0``: never)."""
    if not environment.fast_walk():
        return False

    def nested(depth: int) -> bool:
        return nested(depth - 1) if depth else bool(module.fast_walk_agrees())

    try:
        return nested(4)
    except Exception:  # noqa: BLE001 - the frame-object walk records the same, slower
        return False


def _site_cache(module, fast_walk: bool) -> bool:
    """Cache each stack's walk under the exact sequence of its frames' code objects and instruction
    offsets (``kernel.cpp``, "the call-site cache"): a repeated call site costs one pass of pointer
    reads instead of two hash lookups per frame, for the same records. Only with the fast walk;
    ``environment.SITE_CACHE`` off: never."""
    wanted = fast_walk and environment.site_cache()
    try:
        return bool(module.set_site_cache(wanted))
    except Exception:  # noqa: BLE001 - the full walk records the same, slower
        return False


class NativeKernels:
    """The native kernels of one recorder: registration, state hand-over, polling, counters."""

    def __init__(self, recorder) -> None:
        from moedoctor.recorder import callsite, kernels, progress

        module = load()
        if module is None:
            raise RuntimeError(f"native kernel unavailable: {reason}")
        self._m = module
        self._recorder = recorder
        self.registered = False
        from torch._C._distributed_c10d import ReduceOp

        reductions = {int(v): k.lower() for k, v in ReduceOp.RedOpType.__members__.items()}  # type: ignore[call-overload]
        reduce_names = [reductions.get(i, str(i)) for i in range(max(reductions) + 1)]
        constants = {
            "INTERNAL": callsite.INTERNAL,
            "MODULE_CALL": callsite.MODULE_CALL,
            "FSDP_GROUP": callsite.FSDP_GROUP,
            "CKPT_SAVE": callsite.CKPT_SAVE,
            "CKPT_LOAD": callsite.CKPT_LOAD,
            "MAX_SHAPES": kernels.MAX_SHAPES,
            "MAX_STACK": callsite.MAX_STACK,
            "MAX_WALK": callsite.MAX_WALK,
            "MAX_PENDING": progress.MAX_PENDING,
            "max_events": recorder.max_events,
        }
        module.configure(_Helper(recorder), constants, _dtype_names(module), reduce_names)
        #: The kernel walks CPython's own frames (3.11, 3.12), where that agreed with the frame-object walk.
        self.fast_walk = _fast_walk(module)
        #: Repeated stacks are answered from the call-site cache (fast walk only).
        self.site_cache = _site_cache(module, self.fast_walk)
        #: A cache hit is recorded without taking the GIL (``MOEDOCTOR_GIL_FREE=0``: with it).
        self.gil_free = False
        self.set_gil_free(environment.gil_free())
        #: Records are formatted by the writer thread from raw slots (``MOEDOCTOR_DEFER_FORMAT=0``: on
        #: the recording thread, at once, by the same formatter).
        self.defer_format = environment.defer_format()
        module.set_defer(self.defer_format)
        self.sync_phase()

    # -- registration --------------------------------------------------------------------------

    def register(self, specs) -> None:
        def index(value):
            return -1 if value is None else value

        entries = [
            (
                s.namespace,
                s.raw_name,
                s.op,
                index(s.inputs),
                index(s.outputs),
                s.group,
                index(s.reduce_op),
                index(s.async_op),
                index(s.peer),
                len(s.arg_names),
                index(s.root),
                index(s.in_splits),
                index(s.out_splits),
            )
            for s in specs
        ]
        self._import_state()
        self.set_fd(self._recorder._fd)
        self._m.register_kernels(entries)
        self.registered = True

    def unregister(self) -> None:
        self._m.unregister_kernels()
        self.registered = False
        self._export_state()

    def set_fd(self, fd: int | None) -> None:
        self._m.set_fd(-1 if fd is None else fd)

    def flush(self) -> None:
        """Write the records the kernel buffered (it writes them itself every 2 ms, and from the
        handler of the signals that end a process)."""
        self._m.flush()

    def append(self, record: bytes) -> None:
        """Buffer a record of the Python side's after the kernels' (written with theirs, off the
        caller's thread); dropped once recording stopped."""
        self._m.append(record)

    def stop_releasing(self) -> None:
        """At exit, before finalization: ``poll`` destroys no Work from now on (``Recorder.before_finalization``)."""
        self._m.stop_releasing()

    def write_error(self) -> int:
        """The errno of the kernel's first failed write (0: none); it has stopped writing since."""
        return self._m.write_error()

    # -- what the hot path reads ---------------------------------------------------------------

    def sync_phase(self) -> None:
        recorder = self._recorder
        self._m.set_step(recorder._step)
        self._m.set_optimizer_depth(recorder._optimizer_depth)
        self.set_checkpoint(recorder._checkpoint)

    def set_step(self, value: int) -> None:
        self._m.set_step(value)

    def set_optimizer_depth(self, value: int) -> None:
        self._m.set_optimizer_depth(value)

    def set_checkpoint(self, phase) -> None:
        self._m.set_checkpoint(None if phase is None else phase.value)

    # -- the progress thread and coverage ------------------------------------------------------

    def kernel_time(self) -> tuple[int, ...]:
        """(collectives recorded, nanoseconds spent recording them, of which taking the GIL, walking
        the stack, writing the record, reading the op's arguments before taking the GIL, building the
        record after the walk) while the clock was on (``set_clock``); the rest is leaving (the GIL's
        release). All zero when the clock was never on."""
        return tuple(int(x) for x in self._m.kernel_time())

    def site_cache_counts(self) -> tuple[int, int]:
        """(walks answered from the call-site cache, walks made in full while it was on)."""
        hits, misses, _ = self._m.site_cache_counts()
        return int(hits), int(misses)

    def gil_free_count(self) -> int:
        """Collectives recorded without taking the GIL (call-site cache hits)."""
        return int(self._m.site_cache_counts()[2])

    def set_gil_free(self, on: bool) -> None:
        """Record a call-site cache hit without taking the GIL (on: ``environment.gil_free()``'s default)
        or with it; on only where the cache is (the kernel says)."""
        self.gil_free = bool(self._m.set_gil_free(on))

    def flush_every(self) -> float:
        """The writer thread's period in milliseconds."""
        return float(self._m.flush_every())

    def set_flush_every(self, ms: float) -> None:
        """Benchmarks: the writer thread wakes every ``ms`` milliseconds (at least 0.1) instead."""
        self._m.set_flush_every(float(ms))

    def set_work_futures(self, on: bool) -> None:
        """Benchmarks: a Work with a CPU future reports its completion through it and is not held (on,
        the default), or every Work is held and asked ``isCompleted()`` by the progress thread."""
        self._m.set_work_futures(bool(on))

    def set_defer(self, on: bool) -> None:
        """Benchmarks: format the records on the writer thread (on, the default) or at once on the
        recording thread (``MOEDOCTOR_DEFER_FORMAT=0``); what is pending is written first."""
        self._m.set_defer(on)
        self.defer_format = on

    def set_clock(self, on: bool = True) -> None:
        """Benchmarks only: the kernel times itself by part (eight clock reads and seven shared
        counters per collective, a cost of their own: off in production)."""
        self._m.set_clock(on)

    def poll(self) -> list[int]:
        """Event ids seen complete since the last poll, sorted."""
        return self._m.poll()

    def counts(self) -> tuple[dict[str, tuple[int, int]], int]:
        """({group name: (collectives, p2p ops) recorded}, dropped)."""
        return self._m.counts()

    def assume_completed(self, value: bool = True) -> None:
        """Benchmarks only: count every work complete (the fake backend's never say so)."""
        self._m.set_assume_completed(value)

    # -- state hand-over between the Python and the native kernels -----------------------------

    def _import_state(self) -> None:
        r = self._recorder.records
        with r.lock:
            groups = []
            for name, gid in r.group_ids.items():
                pseq = {peer: n for (g, peer), n in r.p2p_seq.items() if g == name}
                groups.append((name, gid, list(r.ranks.of(name)), r.seq.get(name, 0), r.p2p_count(name), pseq))
            self._m.import_state(r.next_event, r.written, r.dropped, groups, len(r.sites), list(r.sites.items()))

    def _export_state(self) -> None:
        r = self._recorder.records
        next_event, written, dropped, groups, sites, next_site = self._m.export_state()
        with r.lock:
            r.next_event, r.written, r.dropped = next_event, written, dropped
            for name, gid, ranks, seq, p2p_count, pseq in groups:
                r.group_ids[name] = gid
                r.ranks.known.setdefault(name, tuple(ranks))
                r.seq[name] = seq
                r.p2p_seq[("#p2p", name)] = p2p_count
                for peer, n in pseq.items():
                    r.p2p_seq[(name, peer)] = n
            for key, sid in sites:
                r.sites[key] = sid
