"""``key-manifest-checkpoint`` (pattern ``uneven-dtensor-allgather``): one key list for every rank.

Mechanism: the state-dict preprocessing that issues collectives once per DTensor (Megatron-FSDP's
``validate_uneven_dtensor`` loop, seed 003) is wrapped. Before it runs, the ranks agree on one
rank-invariant manifest of the state dict's DTensors, (key, global shape, dtype) sorted by key, with
two fixed-size collectives over the DTensors' shard group: an all-reduce (MAX) of the encoded
manifest's length, then an all-gather of every rank's manifest padded to it. The original then gets
the state dict with its DTensors in manifest order, an empty local shard standing in for each key the
rank lacks (a CPU-offloaded optimizer keeps no state for an empty shard), so every rank issues the
same collectives in the same order. Ranks that disagree on a key's shape or dtype all raise the same
error, since they all decode the same gathered bytes.

The group: the device mesh of the state dict's DTensors (one 1-D mesh; FSDP2 and Megatron-FSDP's
shard group). A rank that holds no DTensor at all reuses the mesh of its previous call, else takes
the default process group: right when the mesh spans the job, which its peers' mesh must then do
(FSDP2 over all ranks); a note says so. State dicts on several meshes, or on an n-D mesh, are left
alone (note): the manifest would have to be agreed per group.

Check (``moedoctor verify``): ``torch.distributed.checkpoint.save`` is wrapped (the package's and
``state_dict_saver``'s, around moedoctor's recorder wrapper); after a save of a state dict that went
through the fix, it is loaded back with ``dcp.load`` into ``zeros_like`` copies and each local shard
must be bitwise equal to what was saved. The ranks first agree (an all-reduce MIN) that every one
of them can run it, so the load cannot desync.

Risk: two small collectives per wrapped call. A key the rank lacks is written as an empty dim-0
shard: right for FSDP2-style (dim-0, ``torch.chunk``) sharding where the lacking rank holds no rows.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moedoctor.fixes.base import Fix, FixConfigError, Target, parse_targets
from moedoctor.fixes.rewrite import parse_branch
from moedoctor.fixes.runtime import agreed_branch, collective_device, first_mapping_argument

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

NAME = "key-manifest-checkpoint"
CHECK = "checkpoint round trip"
StateDict = dict[str, Any]


# -- the manifest (also used by the fixture's --apply-fix: one implementation) ----------------------


@dataclass(frozen=True, order=True)
class ManifestEntry:
    key: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"


def _local_manifest(state_dict: Mapping[str, Any]) -> list[ManifestEntry]:
    from torch.distributed.tensor import DTensor

    return [
        ManifestEntry(key, tuple(value.shape), str(value.dtype).removeprefix("torch."))
        for key, value in state_dict.items()
        if isinstance(value, DTensor)
    ]


def agree_on_dtensor_manifest(
    state_dict: Mapping[str, Any], group: dist.ProcessGroup, device: torch.device
) -> list[ManifestEntry]:
    """The union of every rank's DTensor keys, sorted: the same list on every rank of ``group``.

    Only fixed-size collectives: an all-reduce (MAX) of the encoded length, then an all-gather of
    every rank's manifest padded to that length. So a rank cannot miss or add a call, whatever it holds.
    """
    import torch
    import torch.distributed as dist

    encoded = json.dumps([[e.key, e.shape, e.dtype] for e in _local_manifest(state_dict)]).encode()
    length = torch.tensor([len(encoded)], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    padded = torch.full((int(length.item()),), ord(" "), dtype=torch.uint8)  # JSON ignores spaces
    padded[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, padded, group=group)

    manifest: dict[str, ManifestEntry] = {}
    for payload in gathered:
        for key, shape, dtype in json.loads(_as_bytes(payload)):
            entry = ManifestEntry(key, tuple(shape), dtype)
            # Every rank sees the same gathered data, so a conflict raises on every rank alike.
            if manifest.setdefault(key, entry) != entry:
                raise ValueError(f"ranks disagree on {key}: {manifest[key]} vs {entry}")
    return [manifest[key] for key in sorted(manifest)]  # keys are unique: the entries' order


def _as_bytes(payload: torch.Tensor) -> bytes:
    try:
        return payload.cpu().numpy().tobytes()
    except RuntimeError:  # torch built without numpy
        return bytes(payload.cpu().tolist())


def empty_shard(entry: ManifestEntry, mesh: DeviceMesh, device: torch.device) -> DTensor:
    """A DTensor with this rank's part of ``entry`` empty: it takes part in collectives, writes nothing."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    local = torch.empty((0, *entry.shape[1:]), dtype=getattr(torch, entry.dtype), device=device)
    stride = torch.empty(entry.shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(entry.shape), stride=stride)


def complete_from_manifest(
    state_dict: Mapping[str, Any], manifest: list[ManifestEntry], mesh: DeviceMesh, device: torch.device
) -> StateDict:
    """``state_dict`` with its DTensors in manifest order, the ones this rank lacks as empty shards
    (dim-0 sharded over ``mesh``, like FSDP2), then its other entries."""
    from torch.distributed.tensor import DTensor

    completed: StateDict = {
        e.key: state_dict[e.key] if e.key in state_dict else empty_shard(e, mesh, device) for e in manifest
    }
    completed.update((k, v) for k, v in state_dict.items() if not isinstance(v, DTensor))
    return completed


# -- the fix --------------------------------------------------------------------------------------


def _parse_config(section: Mapping[str, Any]) -> dict:
    unknown = set(section) - {"preprocess", "branch"}
    if unknown:
        raise FixConfigError(f"unknown key(s) {sorted(unknown)}; expected 'preprocess' or 'branch'")
    out: dict[str, Any] = {"targets": parse_targets(section, "preprocess")}
    if section.get("branch") is not None:
        out["branch"] = parse_branch(section["branch"])
    return out


def _install(runtime) -> None:
    branch = runtime.config.get("branch")
    if branch is not None:
        # The per-key `if` that skips a key on some ranks (an empty local shard, a pruned one), agreed:
        # a key is skipped only where every rank would skip it, so every rank walks the same keys.
        runtime.branch(branch, agreed_branch(runtime, branch["agree"]))
    round_trip = _RoundTrip(runtime) if runtime.checks_enabled else None
    meshes = _MeshMemory()

    def make_manifest_ordered(original, owner):
        if not callable(original):
            raise TypeError(f"{original!r} is not callable")

        def preprocess_in_manifest_order(*args, **kwargs):
            place = first_mapping_argument(args, kwargs)
            if place is None:
                runtime.note("the preprocessing function got no state dict (no mapping argument): called unchanged")
                return original(*args, **kwargs)
            state_dict = args[place] if isinstance(place, int) else kwargs[place]
            completed = _in_manifest_order(runtime, state_dict, meshes)
            if isinstance(place, int):
                args = args[:place] + (completed,) + args[place + 1 :]
            else:
                kwargs = {**kwargs, place: completed}
            result = original(*args, **kwargs)
            if round_trip is not None and completed is not state_dict:
                round_trip.expect(result if isinstance(result, Mapping) else completed)
            return result

        return preprocess_in_manifest_order

    for target in runtime.fix.all_targets(runtime.config):
        runtime.patch(target, make_manifest_ordered)
    if round_trip is not None:
        round_trip.install()
        runtime.at_finish(round_trip.finish)


class _MeshMemory:
    """The last device mesh seen, for a rank whose state dict holds no DTensor."""

    def __init__(self) -> None:
        self.mesh = None


def _in_manifest_order(runtime, state_dict: Mapping[str, Any], memory: _MeshMemory) -> Mapping[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    meshes: list = []
    for value in state_dict.values():
        if isinstance(value, DTensor) and value.device_mesh not in meshes:
            meshes.append(value.device_mesh)
    if len(meshes) > 1:
        runtime.note(
            f"the state dict's DTensors are on {len(meshes)} device meshes; one manifest per "
            "group is not supported: left in its own order"
        )
        return state_dict
    if meshes:
        mesh = memory.mesh = meshes[0]
    elif memory.mesh is not None:
        mesh = memory.mesh
    else:
        group = dist.group.WORLD
        device_type = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
        mesh = memory.mesh = DeviceMesh.from_group(group, device_type)  # type: ignore[assignment]
        runtime.note(
            "this rank's state dict holds no DTensor: agreeing on the manifest over the default "
            "process group (right when the other ranks' DTensors are sharded over all ranks)"
        )
    if mesh.ndim != 1:
        runtime.note(
            f"the state dict's DTensors are on a {mesh.ndim}-D device mesh; only 1-D shard "
            "groups are supported: left in its own order"
        )
        return state_dict
    device = _mesh_device(mesh)
    try:
        manifest = agree_on_dtensor_manifest(state_dict, mesh.get_group(), device)
    except ValueError as e:  # the same on every rank: they decoded the same bytes
        runtime.note(f"cannot save: {e}")
        raise ValueError(f"moedoctor {NAME}: {e} (every rank raises this)") from None
    missing = [entry.key for entry in manifest if entry.key not in state_dict]
    if missing:
        runtime.note(
            f"this rank lacked {len(missing)} of {len(manifest)} DTensor key(s) of the save; "
            f"it takes part with empty shards (first: {missing[0]})"
        )
    return complete_from_manifest(state_dict, manifest, mesh, device)


def _mesh_device(mesh) -> torch.device:
    import torch

    if mesh.device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# -- the check ------------------------------------------------------------------------------------


class _RoundTrip:
    """After a save of a state dict the fix completed: load it back, compare local shards bitwise."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.pending: list[Any] | None = None  # tensors of the state dict the fix completed, until saved
        self.local = threading.local()  # inside our own save/load: do not check again
        self.saves = 0

    def expect(self, state_dict: Mapping[str, Any]) -> None:
        self.pending = [value for _, value in _tensor_leaves(state_dict)]

    def finish(self) -> None:
        if self.pending is not None:
            self.runtime.check(
                CHECK,
                None,
                "not checked: the state dict the fix completed was never saved with torch.distributed.checkpoint.save",
            )

    def install(self) -> None:
        from moedoctor._imports import when_imported

        when_imported("torch.distributed.checkpoint", self._wrap_save)

    def _wrap_save(self, package) -> None:
        import sys

        saver = sys.modules.get("torch.distributed.checkpoint.state_dict_saver")
        wrapped: dict[int, Any] = {}
        for module in filter(None, (package, saver)):
            original = getattr(module, "save", None)
            if original is None or getattr(original, "__moedoctor_fix__", None) == NAME:
                continue
            if id(original) not in wrapped:  # the package re-exports the saver's function: wrap it once
                wrapped[id(original)] = self._checking(original)
            module.save = wrapped[id(original)]

    def _checking(self, original):
        @functools.wraps(original)  # keeps the recorder wrapper's marker: it is inside this one
        def save(*args, **kwargs):
            if getattr(self.local, "busy", False) or self.pending is None:
                return original(*args, **kwargs)
            expected, self.pending = self.pending, None
            self.local.busy = True
            try:
                result = original(*args, **kwargs)
                self._check(args[0] if args else kwargs.get("state_dict"), expected, kwargs)
            finally:
                self.local.busy = False
            return result

        save.__moedoctor_fix__ = NAME
        return save

    def _check(self, state_dict: Mapping[str, Any], expected: list[Any], kwargs: dict) -> None:
        """Collective: every rank that completed a state dict since its last save comes here."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.saves += 1
        leaves = _tensor_leaves(state_dict) if isinstance(state_dict, Mapping) else []
        ours = {id(t) for t in expected}
        reader, why = _reader_for(kwargs)
        if not any(id(value) in ours for _, value in leaves):
            reader, why = None, "the saved state dict is not the one the fix completed"
        no_dist = bool(kwargs.get("no_dist")) or not (dist.is_available() and dist.is_initialized())
        group = kwargs.get("process_group")
        if not no_dist:
            votes = torch.tensor([1 if reader is not None else 0], dtype=torch.int64, device=collective_device(group))
            dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
            if reader is not None and not votes.item():
                reader, why = None, "another rank cannot load this checkpoint back"
        if reader is None:
            self.runtime.check(CHECK, None, f"save #{self.saves}: not checked: {why}")
            return
        loaded = _zeros_like_tree(state_dict)
        dcp.load(loaded, process_group=group, no_dist=no_dist, **reader)
        differing, compared = [], 0
        for path, value in leaves:
            compared += 1
            if not _bitwise_equal(_local(_get(loaded, path)), _local(value)):
                differing.append("/".join(map(str, path)))
        if differing:
            self.runtime.check(
                CHECK,
                False,
                f"save #{self.saves}: {len(differing)} of {compared} tensors "
                f"load back different: {', '.join(differing[:4])}"
                f"{' ...' if len(differing) > 4 else ''}",
                float(len(differing)),
            )
        else:
            self.runtime.check(
                CHECK, True, f"save #{self.saves}: {compared} tensors (local shards) load back bitwise equal", 0.0
            )


def _reader_for(kwargs: dict) -> tuple[dict | None, str]:
    """How to load what ``save`` wrote: its ``checkpoint_id``, or the path of a file-system writer."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if kwargs.get("checkpoint_id") is not None:
        return {"checkpoint_id": kwargs["checkpoint_id"]}, ""
    writer = kwargs.get("storage_writer")
    if isinstance(writer, FileSystemWriter):
        return {"storage_reader": FileSystemReader(writer.path)}, ""
    return None, f"cannot tell where {type(writer).__name__} wrote the checkpoint"


def _tensor_leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    import torch

    if isinstance(tree, Mapping):
        return [leaf for key, value in tree.items() for leaf in _tensor_leaves(value, (*path, key))]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, value in enumerate(tree) for leaf in _tensor_leaves(value, (*path, i))]
    return [(path, tree)] if isinstance(tree, torch.Tensor) else []


def _zeros_like_tree(tree: Any) -> Any:
    import torch

    if isinstance(tree, Mapping):
        return {key: _zeros_like_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):  # new containers: dcp.load must not write into the saved tensors
        return (
            [_zeros_like_tree(value) for value in tree]
            if isinstance(tree, list)
            else tuple(_zeros_like_tree(value) for value in tree)
        )
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bitwise_equal(a, b) -> bool:
    import torch

    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True

    def as_bytes(t):
        return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)

    return torch.equal(as_bytes(a), as_bytes(b))


FIX = Fix(
    name=NAME,
    patterns=("uneven-dtensor-allgather",),
    summary="agree on one DTensor key manifest before the per-DTensor checkpoint collectives",
    mechanism="Wraps the state-dict preprocessing that issues collectives per DTensor: the ranks first "
    "agree on the sorted (key, shape, dtype) list of DTensors with two fixed-size collectives, "
    "then every rank preprocesses that list in that order, with an empty shard for a key it lacks.",
    risk="Two small collectives per wrapped call. Missing keys become empty dim-0 shards (FSDP2-style "
    "layout). Ranks that disagree on a key's shape or dtype all raise the same error instead of hanging. "
    "One 1-D shard group per state dict.",
    cost="one 1-element all-reduce and one all-gather of the padded key manifest (bytes: about 60 per "
    "DTensor) per preprocessed state dict",
    check="after a save of a state dict the fix completed, it is loaded back (dcp.load into zeros_like "
    "copies) and every local shard must be bitwise equal to the saved one",
    targets=(Target("_lib.checkpoint:preprocess_fsdp_dtensor_state_dict", "moedoctor's fixtures"),),
    install=_install,
    by_structure="the per-key `if` in your code that skips a key on some ranks (its test made collective)",
    parse_config=_parse_config,
    config_help="preprocess: 'module:function' or a list (takes a flat state dict; issues collectives per DTensor)",
)
