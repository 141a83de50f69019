"""``moedoctor run --check-params``: per-rank parameter fingerprints at chosen points.

Installed only when the runner sets ``MOEDOCTOR_CHECK_PARAMS`` (the optimizer step to fingerprint
after). Hooks, all torch's own:

- a global parameter registration hook remembers every ``nn.Parameter`` registered on a module;
- ``dist.broadcast`` and ``dist._broadcast_coalesced`` (what DDP's constructor and
  ``_sync_module_states`` use) are wrapped: the first time a broadcast writes into a known
  parameter, that parameter's fingerprint is taken just before it (point ``before-broadcast``);
- a global forward pre-hook, at the first forward of a module with parameters (the root), writes the
  ``before-broadcast`` prints and every parameter's print (point ``prepared``), then removes itself and
  the broadcast wrappers;
- a global optimizer step post-hook (registered at that first forward), after step N, writes every
  parameter and optimizer state tensor (point ``step``), then removes itself.

Fingerprints are computed on the tensor's device and kept there; a checkpoint copies all of them to
the host at once (one copy per device), never one synchronization per parameter. Nothing here may
fail the job: an error is said once on stderr and the check stops.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moedoctor.trace import params_format as fmt

_WEIGHTS_LEN = 4096
_weights: dict[torch.device, torch.Tensor] = {}
_state: _ParamCheck | None = None


def _pseudo_random(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        i = torch.arange(1, _WEIGHTS_LEN + 1, dtype=torch.float64)
        w = _weights[device] = (torch.sin(i * 12.9898) * 43758.5453).frac().abs().add(0.5).to(device)
    return w


_CHUNK = 1 << 24  # float64 scratch per tensor at most 128 MiB; a multiple of _WEIGHTS_LEN (same weights)


@torch.no_grad()
def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Five float64 reductions of ``tensor`` (``params_format.FINGERPRINT_FIELDS``), on its device,
    without a host synchronization."""
    x = tensor.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    n = x.numel()
    if n == 0:
        return torch.zeros(5, dtype=torch.float64, device=x.device)
    w = _pseudo_random(x.device)
    parts = []
    for start in range(0, n, _CHUNK):
        c = x[start : start + _CHUNK].to(torch.float64)
        m = c.numel()
        full = m - m % _WEIGHTS_LEN
        wsum = (c[full:] * w[: m - full]).sum()
        if full:
            wsum = wsum + (c[:full].view(-1, _WEIGHTS_LEN) @ w).sum()
        parts.append(torch.stack([c.sum(), (c * c).sum(), wsum, c.min(), c.max()]))
    if len(parts) == 1:
        return parts[0]
    p = torch.stack(parts)
    return torch.stack([p[:, 0].sum(), p[:, 1].sum(), p[:, 2].sum(), p[:, 3].min(), p[:, 4].max()])


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
    """The rank's local tensor and its layout (``None``: a plain tensor)."""
    mesh = getattr(tensor, "device_mesh", None)
    placements = getattr(tensor, "placements", None)
    if mesh is None or placements is None or not hasattr(tensor, "to_local"):
        return tensor, None
    names = []
    for p in placements:
        if p.is_shard():
            names.append(f"S{p.dim}")
        elif p.is_replicate():
            names.append("R")
        else:
            names.append("P")
    layout = {"mesh": mesh.mesh.reshape(-1).tolist(), "shape": list(mesh.mesh.shape), "placements": names}
    return tensor.to_local(), layout


class _ParamCheck:
    def __init__(self, run_dir: Path, step: int) -> None:
        self.folder = run_dir / fmt.FOLDER
        self.step_point = step
        self.lock = threading.Lock()
        self.registered: list[tuple[weakref.ref, str, weakref.ref]] = []  # (module, name, parameter)
        self.by_ptr: dict[int, int] = {}  # data_ptr -> index in registered
        self.indexed = 0
        self.misses: set[int] = set()
        self.before: dict[int, tuple[torch.Tensor, list, dict]] = {}  # index -> (print, meta, extra)
        self.root: weakref.ref | None = None
        self.steps: dict[int, int] = {}  # id(optimizer) -> steps taken
        self.depth = 0  # optimizer steps in progress (nested: an optimizer that steps another)
        self.handles: list = []
        self.originals: dict[str, object] = {}
        self.failed = False
        self.spent: dict[str, float] = {}  # seconds in each hook (benchmarks/fsdp_step_overhead.py)

    # -- hooks -------------------------------------------------------------------------------
    def on_register(self, module: nn.Module, name: str, param) -> None:
        if param is not None:
            self.registered.append((weakref.ref(module), name, weakref.ref(param)))

    def _index(self, ptr: int) -> int | None:
        """The registered parameter whose data starts at ``ptr``; the map is rebuilt when parameters
        were registered since, or once for an unknown pointer (a moved or replaced parameter)."""
        found = self.by_ptr.get(ptr)
        if found is not None or (self.indexed == len(self.registered) and ptr in self.misses):
            return found
        self.by_ptr = {}
        for i, (mref, name, pref) in enumerate(self.registered):
            m = mref()
            # The module's current parameter: one assigned into ``_parameters`` directly (an "empty
            # weights" loader) replaced the registered one without a registration hook.
            p = m._parameters.get(name) if m is not None else pref()
            if p is not None and p.device.type != "meta":
                self.by_ptr.setdefault(p.data_ptr(), i)
        if self.indexed != len(self.registered):
            self.misses.clear()
        self.indexed = len(self.registered)
        found = self.by_ptr.get(ptr)
        if found is None:
            self.misses.add(ptr)
        return found

    def before_broadcast(self, tensors: list, src_global: int, group_ranks: list[int]) -> None:
        now = time.time()
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
                continue
            local, _ = _local(t)
            index = self._index(local.data_ptr())
            if index is None or index in self.before:
                continue
            self.before[index] = (
                fingerprint(local),
                [list(local.shape), str(local.dtype).removeprefix("torch.")],
                {"src": src_global, "group": group_ranks, "time": now},
            )

    @torch.no_grad()
    def on_forward(self, module: nn.Module, args) -> None:
        if self.root is not None or not any(True for _ in module.parameters()):
            return
        self.root = weakref.ref(module)
        self._unhook_prepare()
        names = {id(m): prefix for prefix, m in module.named_modules(remove_duplicate=False)}
        before = []
        for index, (print_, (shape, dtype), extra) in self.before.items():
            mref, local_name, _ = self.registered[index]
            m = mref()
            if m is None or id(m) not in names:
                continue
            prefix = names[id(m)]
            before.append(([f"{prefix}.{local_name}" if prefix else local_name, shape, dtype, None], print_, extra))
        self.before.clear()
        if before:
            self.write(fmt.POINT_BEFORE_BROADCAST, 0, before)
        self.write(fmt.POINT_PREPARED, 0, self._params(module))
        from torch.optim.optimizer import (  # not while torch is being imported
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.handles.append(register_optimizer_step_pre_hook(_guard(self, self.on_step_start)))
        self.handles.append(register_optimizer_step_post_hook(_guard(self, self.on_step)))

    def on_step_start(self, optimizer, args, kwargs) -> None:
        self.depth += 1

    @torch.no_grad()
    def on_step(self, optimizer, args, kwargs) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth:  # an optimizer stepped by another (ZeroRedundancyOptimizer's local one): wait for the outer
            return
        n = self.steps[id(optimizer)] = self.steps.get(id(optimizer), 0) + 1
        if n != self.step_point:
            return
        root = self.root() if self.root is not None else None
        items = self._params(root) if root is not None else []
        names = {id(p): name for name, p in root.named_parameters()} if root is not None else {}
        for group_index, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                name = names.get(id(p), f"param_groups[{group_index}][{k}]")
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        items.append(self._item(f"{name}#{key}", value))
        self.write(fmt.POINT_STEP, n, items)
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- writing -----------------------------------------------------------------------------
    def _item(self, name: str, tensor: torch.Tensor):
        local, layout = _local(tensor)
        return [name, list(local.shape), str(local.dtype).removeprefix("torch."), layout], fingerprint(local), {}

    def _params(self, module: nn.Module) -> list:
        return [self._item(name, p) for name, p in module.named_parameters() if p.device.type != "meta"]

    def write(self, point: str, step: int, items: list) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, print_, _) in enumerate(items):
            by_device.setdefault(print_.device, []).append(i)
        values: list[list[float]] = [[]] * len(items)
        for indices in by_device.values():
            host = torch.stack([items[i][1] for i in indices]).cpu().tolist()  # one copy per device
            for i, row in zip(indices, host):
                values[i] = row
        tensors = [[*meta, values[i], extra] for i, (meta, _, extra) in enumerate(items)]
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        line = fmt.encode(point, rank, world, time.time(), step, tensors)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / fmt.file_name(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _unhook_prepare(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        self.originals.clear()
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _guard(check: _ParamCheck, fn):
    name = fn.__name__

    def hook(*args, **kwargs):
        if check.failed:
            return None
        start = time.perf_counter()
        try:
            with check.lock:
                return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the check never fails the job
            check.failed = True
            print(f"moedoctor: --check-params stopped on this rank: {e!r}", file=sys.stderr)
            return None
        finally:
            check.spent[name] = check.spent.get(name, 0.0) + time.perf_counter() - start

    return hook


def _group_ranks(group) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def install(run_dir: Path, step: int) -> _ParamCheck:
    """Install the check once per process (``moedoctor.recorder.install`` calls it when the option is on)."""
    global _state
    if _state is not None:
        return _state
    check = _state = _ParamCheck(run_dir, step)
    before = _guard(check, check.before_broadcast)
    broadcast, coalesced = dist.broadcast, getattr(dist, "_broadcast_coalesced", None)

    def traced_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        if src is None and group_src is not None:
            src = dist.get_global_rank(group, group_src) if group is not None else group_src
        before([tensor], src, _group_ranks(group))
        if group_src is not None:
            return broadcast(tensor, group=group, async_op=async_op, group_src=group_src)
        return broadcast(tensor, src, group=group, async_op=async_op)

    check.originals["broadcast"] = broadcast
    dist.broadcast = traced_broadcast
    if coalesced is not None:

        def traced_coalesced(process_group, tensors, buffer_size, src=0):
            ranks = _group_ranks(process_group)
            before(list(tensors), ranks[src] if src < len(ranks) else src, ranks)
            return coalesced(process_group, tensors, buffer_size, src)

        check.originals["_broadcast_coalesced"] = coalesced
        dist._broadcast_coalesced = traced_coalesced
    hooks = nn.modules.module
    check.handles.append(hooks.register_module_parameter_registration_hook(_guard(check, check.on_register)))
    check.handles.append(hooks.register_module_forward_pre_hook(_guard(check, check.on_forward)))
    return check


def installed() -> _ParamCheck | None:
    return _state
