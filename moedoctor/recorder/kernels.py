"""The Python dispatcher kernels: one per collective op at ``BackendSelect``, each writing the op's
``c`` record (``schema.encode_collective``) before redispatching it. The hot path of every collective
(the native kernel, ``native/kernel.cpp``, is its C++ twin).

The kernels read the recorder's phase state (step, optimizer depth, checkpoint) and write through its
``TraceRecords``; they import neither the ``Recorder`` nor the native kernel."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp

from moedoctor.events import Phase
from moedoctor.recorder import callsite
from moedoctor.recorder.ops import OpSpec
from moedoctor.recorder.records import json_str
from moedoctor.trace.schema import encode_collective

if TYPE_CHECKING:
    from moedoctor.recorder.core import Recorder

MAX_SHAPES = 64  # tensors described per side of one collective; the rest are counted, not listed
_REDUCE_NAMES = {int(v): k.lower() for k, v in ReduceOp.RedOpType.__members__.items()}  # type: ignore[call-overload]
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_thread_names: dict[int, str] = {}  # thread ident -> its name, JSON-encoded


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


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
        encoded = _devices[device] = json_str(str(device))
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


def reduce_name(value) -> str | None:
    """A reduce op's name (``sum``, ``avg``, ...), from c10d's ``ReduceOp`` or a functional string."""
    if isinstance(value, str):
        return value.lower()
    try:
        return _REDUCE_NAMES.get(int(value.op()), str(value))
    except Exception:
        return None


def _arg(spec: OpSpec, index: int | None, args: tuple, kwargs: dict, default=None):
    if index is None:
        return default
    if index < len(args):
        return args[index]
    return kwargs.get(spec.arg_names[index], default)


class PythonKernels:
    """The kernels of one recorder, registered at the dispatcher (one ``torch.library.Library`` per
    op namespace) until ``unregister``."""

    def __init__(self, recorder: Recorder):
        self._recorder = recorder
        self._records = recorder.records
        self._libraries: list[torch.library.Library] = []
        self._inside = threading.local()

    @property
    def registered(self) -> bool:
        return bool(self._libraries)

    def register(self, specs: list[OpSpec]) -> None:
        libraries: dict[str, torch.library.Library] = {}
        for spec in specs:
            lib = libraries.get(spec.namespace)
            if lib is None:
                lib = libraries[spec.namespace] = torch.library.Library(spec.namespace, "IMPL")
            lib.impl(spec.raw_name, self._kernel(spec), "BackendSelect", with_keyset=True)
        self._libraries = list(libraries.values())

    def unregister(self) -> None:
        for lib in self._libraries:
            lib._destroy()
        self._libraries = []

    # -- the hot path ----------------------------------------------------------------------------

    def _kernel(self, spec: OpSpec) -> Callable:
        handle = spec.packet._handle  # type: ignore[attr-defined]
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        track = spec.namespace == "c10d"
        inside = self._inside
        writer = self._records.writer
        recorder = self._recorder

        def kernel(keyset, *args, **kwargs):
            # Redispatch with an explicit keyset: calling the op from Python would probe every
            # ScriptObject argument for __torch_function__, which costs more than the recording.
            if getattr(inside, "active", False):  # a functional collective's own c10d call
                return handle.redispatch_boxed(keyset & after, *args, **kwargs)
            event_id = None
            if writer.fd is not None:
                try:
                    event_id, group_id, on_cpu = self._record(spec, args, kwargs)
                except Exception as e:  # the job must never fail because of the recorder
                    recorder.internal_error(spec.qualified, e)
            inside.active = True
            try:
                out = handle.redispatch_boxed(keyset & after, *args, **kwargs)
            finally:
                inside.active = False
            if event_id is not None and track:
                work = out[-1] if isinstance(out, tuple) else out
                reduce_op = args[spec.reduce_op] if spec.reduce_op is not None and spec.reduce_op < len(args) else None
                recorder.fresh.append((event_id, group_id, work, reduce_op, on_cpu))
            return out

        return kernel

    def _record(self, spec: OpSpec, args: tuple, kwargs: dict) -> tuple[int | None, int, bool]:
        """Write one collective record; returns its event id (None once the cap is reached), its
        group's id, and whether its first input tensor is on the CPU (its Work's future then reports
        completion: recorder/progress.py). The hot path of every collective: formatted by hand (json.dumps costs three
        times as much), each argument fetched once."""
        records = self._records
        count = len(args)
        index = spec.group
        group_arg = args[index] if index < count else kwargs[spec.arg_names[index]]
        if spec.namespace == "c10d":
            group_name: str = ProcessGroup.unbox(group_arg).group_name
        else:
            group_name = group_arg if isinstance(group_arg, str) else group_arg.group_name
        inputs = _tensors(_arg(spec, spec.inputs, args, kwargs))
        if inputs and type(inputs[0]) not in _PLAIN and _traced(inputs[0]):
            return None, -1, False  # torch.compile tracing the collective with fake tensors: nothing is sent
        attribution = callsite.attribute(3)
        outputs = _tensors(_arg(spec, spec.outputs, args, kwargs))
        reduce_op = counts = splits = root = module = peer_json = None
        if spec.reduce_op is not None and spec.namespace != "c10d":
            # c10d passes a TorchScript ReduceOp whose .op() costs more than this whole record:
            # the progress thread resolves it (recorder/progress.py).
            reduce_op = f'"{reduce_name(_arg(spec, spec.reduce_op, args, kwargs))}"'
        if len(inputs) > MAX_SHAPES or len(outputs) > MAX_SHAPES:
            counts = f"[{len(inputs)},{len(outputs)}]"
        if spec.out_splits is not None:
            ins = _arg(spec, spec.in_splits, args, kwargs, ())
            outs = _arg(spec, spec.out_splits, args, kwargs, ())
            splits = f"[[{','.join(map(str, map(int, ins)))}],[{','.join(map(str, map(int, outs)))}]]"
        if spec.root is not None:
            root_rank = records.ranks.global_rank(group_name, _arg(spec, spec.root, args, kwargs))
            root = "null" if root_rank is None else root_rank
        if attribution.fsdp_module is not None:
            module = json_str(attribution.fsdp_module)
        peer = None
        if spec.peer is not None:
            peer = records.ranks.global_rank(group_name, _arg(spec, spec.peer, args, kwargs))
            peer_json = "null" if peer is None else peer
        index = spec.async_op
        is_async = spec.namespace != "c10d" or (
            args[index] if index is not None and index < count else kwargs.get("async_op", True)
        )
        thread = _thread_names.get(get_ident())
        if thread is None:
            thread = _thread_names[get_ident()] = json_str(threading.current_thread().name)
        recorder = self._recorder
        now, phase = f"{time.time():.6f}", _PHASES[self._phase(attribution)]
        device = _device(inputs[0]) if inputs else None
        site_key = attribution.site_key
        with records.lock:
            gid = records.group_ids.get(group_name)
            if gid is None:
                gid = records.group_id(group_name)
            sid = records.sites.get(site_key) if site_key else "null"
            if sid is None:
                sid = records.site_id(site_key)
            event_id = records.next_event
            records.next_event += 1
            pseq = None
            if spec.peer is not None:
                key = (group_name, peer)
                pseq = records.p2p_seq[key] = records.p2p_seq.get(key, 0) + 1
                records.count_p2p(group_name)
                seq = records.seq.get(group_name, 0)  # collectives before it; not advanced
            else:
                seq = records.seq[group_name] = records.seq.get(group_name, 0) + 1
            if records.written >= records.max_events:
                records.drop()
                return None, gid, False
            records.written += 1
            records.write(
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
                    recorder.step,
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
        return event_id, gid, bool(inputs) and inputs[0].device.type == "cpu"

    def _phase(self, attribution: callsite.Attribution) -> Phase:
        recorder = self._recorder
        if recorder.checkpoint is not None:
            return recorder.checkpoint
        flags = attribution.flags
        if flags & callsite.CKPT_LOAD:
            return Phase.CHECKPOINT_LOAD
        if flags & callsite.CKPT_SAVE:
            return Phase.CHECKPOINT_SAVE
        if recorder.optimizer_depth:
            return Phase.OPTIMIZER
        if torch._C._current_graph_task_id() != -1:
            return Phase.BACKWARD
        if flags & callsite.MODULE_CALL:
            return Phase.FORWARD
        return Phase.OTHER


def is_nccl(pg) -> bool:
    try:
        return "nccl" in str(dist.get_backend(pg)).lower()
    except Exception:
        return False
