"""The recorder: one per rank process, fed by Python kernels registered at the dispatcher.

Every collective is written to this rank's trace with ``os.write`` before the op is issued, so the
record survives a SIGKILL or a Gloo SIGABRT a millisecond later. A small background thread notices
completed ``Work`` objects, answers snapshot requests from the watchdog and keeps nothing else.

The kernels sit at the ``BackendSelect`` dispatch key, which is in every thread's default included
set and a fallthrough for these ops: below autograd (so the functional collectives keep their
registered autograd formulas, and their backward collectives are seen too), and still reached where
autograd's guard has excluded everything above the backends: inside DTensor's ``__torch_dispatch__``
(``clip_grad_norm_`` on DTensors), for inference-mode tensors, from C++ callers such as the DDP
reducer and from every thread. A collective issued from inside another one's kernel (a functional
collective calling its process group) is not counted twice. The coverage check compares the counts
with the backend's own sequence counter.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from threading import get_ident
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp

import moedoctor
from moedoctor import environment
from moedoctor.events import Phase
from moedoctor.layout import RunDir
from moedoctor.recorder import callsite
from moedoctor.recorder.ops import OpSpec, all_specs
from moedoctor.recorder.progress import Progress
from moedoctor.recorder.writer import TraceWriter
from moedoctor.trace import format as fmt
from moedoctor.trace.schema import encode_collective

DEFAULT_MAX_EVENTS = environment.DEFAULT_MAX_EVENTS
_REDUCE_NAMES = {int(v): k.lower() for k, v in ReduceOp.RedOpType.__members__.items()}  # type: ignore[call-overload]
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_json_strings: dict[str, str] = {}
_thread_names: dict[int, str] = {}  # thread ident -> its name, JSON-encoded


def _json_str(value: str) -> str:
    encoded = _json_strings.get(value)
    if encoded is None:
        encoded = _json_strings[value] = json.dumps(value)
    return encoded


def _shapes(tensors: list[torch.Tensor]) -> str:
    if len(tensors) == 1:
        return f"[[{','.join(map(str, tensors[0].shape))}]]"
    return "[" + ",".join("[" + ",".join(map(str, t.shape)) + "]" for t in tensors[:MAX_SHAPES]) + "]"


def _dtypes(tensors: list[torch.Tensor]) -> str:
    if len(tensors) == 1:
        return f'["{_dtype_name(tensors[0].dtype)}"]'
    names = dict.fromkeys(_dtype_name(t.dtype) for t in tensors[:MAX_SHAPES])
    return "[" + ",".join(f'"{n}"' for n in names) + "]"


_devices: dict[torch.device, str] = {}


def _device(tensor: torch.Tensor) -> str:
    """The tensor's device as JSON text: ``"cpu"``, ``"cuda:0"``."""
    device = tensor.device
    encoded = _devices.get(device)
    if encoded is None:
        encoded = _devices[device] = _json_str(str(device))
    return encoded


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an op argument: a tensor, a list of them, or a list of lists (all_gather)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out = []
        for item in value:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (list, tuple)):
                out.extend(t for t in item if isinstance(t, torch.Tensor))
        return out
    return []


def _traced(tensor: torch.Tensor) -> bool:
    """A tensor that only stands for one while a graph is traced (torch.compile's fake and functional
    tensors, meta tensors): a collective on it sends nothing and advances no backend counter."""
    keys = torch._C._dispatch_keys(tensor)
    return tensor.is_meta or keys.has(torch._C.DispatchKey.Python) or keys.has(torch._C.DispatchKey.Functionalize)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PHASES = {phase: f'"{phase.value}"' for phase in Phase}  # as JSON


def _is_nccl(pg) -> bool:
    try:
        return "nccl" in str(dist.get_backend(pg)).lower()
    except Exception:
        return False


MAX_SHAPES = 64  # tensors described per side of one collective; the rest are counted, not listed


class Recorder:
    """Writes this rank's trace. Created by ``install``; opened when the default group exists."""

    def __init__(self, run_dir: Path, max_events: int = DEFAULT_MAX_EVENTS, poll_interval: float = 0.2):
        self.run_dir = Path(run_dir)
        self.max_events = max_events
        self.poll_interval = poll_interval
        self._native: Any = None  # [native seam] NativeKernels while MOEDOCTOR_NATIVE=1 and it loaded
        self.step = 0
        self.optimizer_depth = 0
        #: ``pause()``: no kernel in front of the collectives, every evidence hook passes straight
        #: through (the benchmarks' in-process toggle of the whole recorder).
        self.paused = False
        self.checkpoint: Phase | None = None
        self._lock = threading.Lock()
        self._writer = TraceWriter(events=self._events_recorded, on_stop=self._stopped_writing)
        self._write = self._writer.write
        self._progress = Progress(self, poll_interval)
        self._fresh = self._progress.fresh  # the kernels hand the progress thread their Work here
        self._next_event = 0
        self._written = 0
        self._dropped = 0
        self._group_ids: dict[str, int] = {}
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        self._seq: dict[str, int] = {}
        self._p2p_seq: dict[tuple, int] = {}
        self._sites: dict[tuple, int] = {}
        self._rank = -1
        self._errors = 0
        self._libraries: list[torch.library.Library] = []
        self._inside = threading.local()

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._writer.fd is not None

    @property
    def _fd(self) -> int | None:
        return self._writer.fd

    # -- [native seam] state the hot path reads: forwarded to the native kernel when it is active ---

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        if self._native is not None:
            self._native.set_step(value)

    @property
    def optimizer_depth(self) -> int:
        return self._optimizer_depth

    @optimizer_depth.setter
    def optimizer_depth(self, value: int) -> None:
        self._optimizer_depth = value
        if self._native is not None:
            self._native.set_optimizer_depth(value)

    @property
    def checkpoint(self) -> Phase | None:
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, value: Phase | None) -> None:
        self._checkpoint = value
        if self._native is not None:
            self._native.set_checkpoint(value)

    def _use_native(self) -> bool:
        """[native seam] MOEDOCTOR_NATIVE=1 and the extension builds; else the Python kernels."""
        from moedoctor.recorder import native

        if not native.requested():
            return False
        if self._native is None:
            try:
                if native.available():
                    self._native = native.NativeKernels(self)
                    self._writer.before_write = self._native.flush
            except Exception as e:  # never fail the job: the Python kernels record it
                native.reason = f"{type(e).__name__}: {e}"
            if self._native is None:
                print(
                    f"moedoctor: native kernel unavailable, using the Python kernels: {native.reason}", file=sys.stderr
                )
                return False
        return True

    # -- [end native seam] ---------------------------------------------------------------------

    def register_kernels(self) -> None:
        """Put a recording kernel in front of every collective op this torch build has."""
        if self._libraries or (self._native is not None and self._native.registered):
            return
        if self._use_native():  # [native seam]
            self._native.register(all_specs())
            return
        libraries: dict[str, torch.library.Library] = {}
        for spec in all_specs():
            lib = libraries.get(spec.namespace)
            if lib is None:
                lib = libraries[spec.namespace] = torch.library.Library(spec.namespace, "IMPL")
            lib.impl(spec.raw_name, self._kernel(spec), "BackendSelect", with_keyset=True)
        self._libraries = list(libraries.values())

    def pause(self) -> None:
        """Record nothing until ``resume()``: the kernels come off the dispatcher, the evidence hooks
        pass through (they stay installed: torch offers no way to remove global hooks) and the
        progress thread idles (it wakes, sees the pause and sleeps again). The benchmarks' in-process
        toggle of the whole recorder; the native kernel's flush thread keeps waking every 2 ms, with
        nothing to write."""
        self.paused = True
        self._progress.idle = True
        self.unregister_kernels()

    def resume(self) -> None:
        self.register_kernels()
        self.paused = False
        self._progress.idle = False

    def unregister_kernels(self) -> None:
        if self._native is not None and self._native.registered:  # [native seam]
            self._native.unregister()
        for lib in self._libraries:
            lib._destroy()
        self._libraries = []

    def open(self) -> None:
        """Create this rank's status and trace files and write the header; start the progress
        thread. Never raises: a file that cannot be created stops the recording (``stop_recording``)."""
        if self._fd is not None or self.stopped is not None:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        self._rank = rank
        if not self._writer.open(RunDir(self.run_dir).traces, rank):
            return
        if self._native is not None:  # [native seam]
            self._native.set_fd(self._fd)
        header = {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
            "world_size": world,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "torch": torch.__version__,
            "moedoctor": moedoctor.__version__,
            "start_time": time.time(),
        }
        self._write(fmt.encode(header))
        if self._fd is None:  # the header could not be written: recording stopped already
            return
        self._progress.start()

    def flush(self) -> None:
        """Write what the native kernel buffered (``os._exit``'s wrapper calls it: no atexit runs)."""
        if self._native is not None and self._fd is not None:  # [native seam]
            self._native.flush()

    def close(self, reason: str) -> None:
        """Write the coverage record and stop the progress thread (once)."""
        if self._fd is None or self._progress.stopping:
            return
        self._progress.finish()
        self.write_coverage(reason)

    # -- the hot path ----------------------------------------------------------------------------

    def _kernel(self, spec: OpSpec) -> Callable:
        handle = spec.packet._handle  # type: ignore[attr-defined]
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        track = spec.namespace == "c10d"
        inside = self._inside

        def kernel(keyset, *args, **kwargs):
            # Redispatch with an explicit keyset: calling the op from Python would probe every
            # ScriptObject argument for __torch_function__, which costs more than the recording.
            if getattr(inside, "active", False):  # a functional collective's own c10d call
                return handle.redispatch_boxed(keyset & after, *args, **kwargs)
            event_id = None
            if self._fd is not None:
                try:
                    event_id, group_id = self._record(spec, args, kwargs)
                except Exception as e:  # the job must never fail because of the recorder
                    self._internal_error(spec, e)
            inside.active = True
            try:
                out = handle.redispatch_boxed(keyset & after, *args, **kwargs)
            finally:
                inside.active = False
            if event_id is not None and track:
                work = out[-1] if isinstance(out, tuple) else out
                reduce_op = args[spec.reduce_op] if spec.reduce_op is not None and spec.reduce_op < len(args) else None
                self._fresh.append((event_id, group_id, work, reduce_op))
            return out

        return kernel

    def _arg(self, spec: OpSpec, index: int | None, args: tuple, kwargs: dict, default=None):
        if index is None:
            return default
        if index < len(args):
            return args[index]
        return kwargs.get(spec.arg_names[index], default)

    def _record(self, spec: OpSpec, args: tuple, kwargs: dict) -> tuple[int | None, int]:
        """Write one collective record; returns its event id (None once the cap is reached) and
        its group's id. The hot path of every collective: formatted by hand (json.dumps costs three
        times as much), each argument fetched once."""
        count = len(args)
        index = spec.group
        group_arg = args[index] if index < count else kwargs[spec.arg_names[index]]
        if spec.namespace == "c10d":
            group_name: str = ProcessGroup.unbox(group_arg).group_name
        else:
            group_name = group_arg if isinstance(group_arg, str) else group_arg.group_name
        inputs = _tensors(self._arg(spec, spec.inputs, args, kwargs))
        if inputs and type(inputs[0]) not in _PLAIN and _traced(inputs[0]):
            return None, -1  # torch.compile tracing the collective with fake tensors: nothing is sent
        attribution = callsite.attribute(3)
        outputs = _tensors(self._arg(spec, spec.outputs, args, kwargs))
        reduce_op = counts = splits = root = module = peer_json = None
        if spec.reduce_op is not None and spec.namespace != "c10d":
            # c10d passes a TorchScript ReduceOp whose .op() costs more than this whole record:
            # the progress thread resolves it (recorder/progress.py).
            reduce_op = f'"{self.reduce_name(self._arg(spec, spec.reduce_op, args, kwargs))}"'
        if len(inputs) > MAX_SHAPES or len(outputs) > MAX_SHAPES:
            counts = f"[{len(inputs)},{len(outputs)}]"
        if spec.out_splits is not None:
            ins = self._arg(spec, spec.in_splits, args, kwargs, ())
            outs = self._arg(spec, spec.out_splits, args, kwargs, ())
            splits = f"[[{','.join(map(str, map(int, ins)))}],[{','.join(map(str, map(int, outs)))}]]"
        if spec.root is not None:
            root_rank = self._global_rank(group_name, self._arg(spec, spec.root, args, kwargs))
            root = "null" if root_rank is None else root_rank
        if attribution.fsdp_module is not None:
            module = _json_str(attribution.fsdp_module)
        peer = None
        if spec.peer is not None:
            peer = self._global_rank(group_name, self._arg(spec, spec.peer, args, kwargs))
            peer_json = "null" if peer is None else peer
        index = spec.async_op
        is_async = spec.namespace != "c10d" or (
            args[index] if index is not None and index < count else kwargs.get("async_op", True)
        )
        thread = _thread_names.get(get_ident())
        if thread is None:
            thread = _thread_names[get_ident()] = _json_str(threading.current_thread().name)
        now, phase = f"{time.time():.6f}", _PHASES[self._phase(attribution)]
        device = _device(inputs[0]) if inputs else None
        site_key = attribution.site_key
        with self._lock:
            gid = self._group_ids.get(group_name)
            if gid is None:
                gid = self._group_id(group_name)
            sid = self._sites.get(site_key) if site_key else "null"
            if sid is None:
                sid = self._site_id(site_key)
            event_id = self._next_event
            self._next_event += 1
            pseq = None
            if spec.peer is not None:
                key = (group_name, peer)
                pseq = self._p2p_seq[key] = self._p2p_seq.get(key, 0) + 1
                self._count_p2p(group_name)
                seq = self._seq.get(group_name, 0)  # collectives before it; not advanced
            else:
                seq = self._seq[group_name] = self._seq.get(group_name, 0) + 1
            if self._written >= self.max_events:
                self._drop()
                return None, gid
            self._written += 1
            self._write(
                encode_collective(
                    event_id,
                    gid,
                    seq,
                    sid,
                    now,
                    spec.op_json,
                    spec.qualified_json,
                    _shapes(inputs),
                    _shapes(outputs),
                    _dtypes(inputs),
                    "true" if is_async else "false",
                    thread,
                    phase,
                    self.step,
                    p2p_seq=pseq,
                    reduce_op=reduce_op,
                    counts=counts,
                    splits=splits,
                    root=root,
                    module=module,
                    peer=peer_json,
                    device=device,
                ).encode()
            )
        return event_id, gid

    def _phase(self, attribution: callsite.Attribution) -> Phase:
        if self.checkpoint is not None:
            return self.checkpoint
        flags = attribution.flags
        if flags & callsite.CKPT_LOAD:
            return Phase.CHECKPOINT_LOAD
        if flags & callsite.CKPT_SAVE:
            return Phase.CHECKPOINT_SAVE
        if self.optimizer_depth:
            return Phase.OPTIMIZER
        if torch._C._current_graph_task_id() != -1:
            return Phase.BACKWARD
        if flags & callsite.MODULE_CALL:
            return Phase.FORWARD
        return Phase.OTHER

    @staticmethod
    def reduce_name(value) -> str | None:
        if isinstance(value, str):
            return value.lower()
        try:
            return _REDUCE_NAMES.get(int(value.op()), str(value))
        except Exception:
            return None

    # -- interning (called under the lock) -------------------------------------------------------

    def _group_id(self, name: str) -> int:
        gid = self._group_ids.get(name)
        if gid is None:
            gid = self._group_ids[name] = len(self._group_ids)
            ranks = self._ranks_of(name)
            desc = getattr(self._process_group(name), "group_desc", "")
            self._write(fmt.encode({"k": fmt.GROUP, "id": gid, "name": name, "desc": desc, "ranks": list(ranks)}))
        return gid

    def _site_id(self, site_key: tuple) -> int:
        sid = self._sites.get(site_key)
        if sid is None:
            sid = self._sites[site_key] = len(self._sites)
            file, line, fn, stack = callsite.describe(site_key)
            self._write(fmt.encode({"k": fmt.SITE, "id": sid, "file": file, "line": line, "fn": fn, "stack": stack}))
        return sid

    def _count_p2p(self, group_name: str) -> None:
        key = ("#p2p", group_name)
        self._p2p_seq[key] = self._p2p_seq.get(key, 0) + 1

    # -- process groups --------------------------------------------------------------------------

    @staticmethod
    def _process_group(name: str):
        from torch.distributed.distributed_c10d import _world

        for pg, pg_name in list(_world.pg_names.items()):
            if pg_name == name:
                return pg
        return None

    def _ranks_of(self, name: str) -> tuple[int, ...]:
        ranks = self._group_ranks.get(name)
        if ranks is None:
            pg = self._process_group(name)
            if pg is None:
                ranks = ()
            else:
                from torch.distributed.distributed_c10d import _world

                mapping = _world.pg_group_ranks.get(pg, {})
                ranks = tuple(sorted(mapping, key=mapping.get)) or tuple(range(dist.get_world_size()))
            self._group_ranks[name] = ranks
        return ranks

    def _global_rank(self, group_name: str, group_rank) -> int | None:
        if group_rank is None:
            return None
        ranks = self._ranks_of(group_name)
        return ranks[group_rank] if 0 <= group_rank < len(ranks) else int(group_rank)

    # -- output ----------------------------------------------------------------------------------

    @property
    def stopped(self) -> str | None:
        """Why recording stopped (a write of ours failed); None while it runs."""
        return self._writer.stopped

    def stop_recording(self, error: OSError) -> None:
        """A write of ours failed: write nothing more; the job goes on (``TraceWriter.stop``)."""
        self._writer.stop(error)

    def _stopped_writing(self) -> None:
        if self._native is not None:  # [native seam]
            self._native.set_fd(None)
        self._progress.clear()

    def _events_recorded(self) -> int:
        """Collectives and p2p ops recorded so far (on either kernel)."""
        if self._native is not None and self._native.registered:  # [native seam] counters live in C++
            try:
                return sum(c + p for c, p in self._native.counts()[0].values())
            except Exception:  # noqa: BLE001 - only a number in a message
                return self._next_event
        return self._next_event

    def _drop(self) -> None:
        if self._dropped == 0:
            self._write(fmt.encode({"k": fmt.CAP, "t": time.time(), "limit": self.max_events}))
        self._dropped += 1

    def write_evidence(self, kind: str, data: dict | None = None, step: int | None = None) -> None:
        if self._fd is None:
            return
        record = {"k": fmt.EVIDENCE, "t": time.time(), "kind": kind, "step": self.step if step is None else step}
        if data:
            record["data"] = data
        native = self._native
        with self._lock:
            if native is not None:  # [native seam] buffered with the kernels' records: no write(2) here
                native.append(fmt.encode(record))
            else:
                self._write(fmt.encode(record))

    def write_record(self, record: dict) -> None:
        """Write one record other than a collective (an exception) at once: the native kernel's
        buffered records first, then this one with one ``os.write``. Gives up after a second if a
        thread holds the lock (the process may be going down with it)."""
        if self._fd is None:
            return
        if self._lock.acquire(timeout=1.0):
            try:
                self._write(fmt.encode(record))
            finally:
                self._lock.release()

    def defer(self, ready: Callable[[], bool], emit: Callable[[], None]) -> None:
        """Have the progress thread call ``emit`` once ``ready()`` is true (a GPU value has landed)."""
        self._progress.defer(ready, emit)

    def write_coverage(self, reason: str) -> None:
        """Compare each group's recorded count with the backend's own sequence counter (NCCL's
        counts collectives only; Gloo's counts p2p ops too)."""
        from torch.distributed.distributed_c10d import _world

        counts: dict[str, tuple[int, int]] = {}
        dropped = self._dropped
        if self._native is not None and self._native.registered:  # [native seam] counters live in C++
            counts, dropped = self._native.counts()
        groups = []
        for pg, name in list(_world.pg_names.items()):
            try:
                backend = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
            except Exception:
                backend = None
            collectives, p2p = counts.get(name) or (self._seq.get(name, 0), self._p2p_seq.get(("#p2p", name), 0))
            groups.append([name, collectives + (0 if _is_nccl(pg) else p2p), backend])
        with self._lock:
            self._write(
                fmt.encode(
                    {"k": fmt.COVERAGE, "t": time.time(), "reason": reason, "groups": groups, "dropped": dropped}
                )
            )

    def _internal_error(self, spec: OpSpec, error: Exception) -> None:
        self._errors += 1
        if self._errors <= 3:
            self.write_evidence("recorder_error", {"op": spec.qualified, "error": repr(error)})
