"""Pattern ``overwritten-shards`` and the parameter consistency check (``moedoctor run --check-params``).

Mechanism: with expert parallelism each rank holds different parameters (its experts); a preparation
step that broadcasts every tensor of the model from rank 0 (accelerate's ``sync_module_states`` / RAM-
efficient loading, DDP's constructor, a "load on rank 0 then broadcast" loader) overwrites them with
rank 0's. Nothing hangs and nothing raises: the job trains on broken weights (seed 004).

Evidence, from the per-rank fingerprints (``moedoctor.trace.params_format``) and the layout each
parameter has by structure, never by name:

- a DTensor parameter's mesh and placements give its groups: ranks along a ``Replicate`` mesh dim must
  hold the same local tensor, ranks along a ``Shard`` dim different ones (identical shards of a constant
  tensor, ones or zeros, are fine);
- a plain parameter is assumed replicated over the world, unless it already differed across ranks
  when it was first seen: before its first broadcast, or at the first forward when it was never
  broadcast (then it is per-rank by construction and left alone). One that differed before a broadcast
  and is identical after it was overwritten; the claim is made only when other parameters broadcast in
  the same preparation already agreed before theirs (the difference was deliberate, not an empty rank
  waiting for rank 0's weights);
- optimizer state (``<param>#<key>``) that differs across ranks where its parameter agrees.

The broadcast that overwrote a parameter is taken from the trace: the ``broadcast`` on the recorded
group, from the recorded source, with the parameter's local shape and dtype, nearest in time.

Fix: make the per-rank parameters DTensors ``Shard(0)`` on the expert-parallel mesh (the preparation
then treats them as shards), or leave them out of the broadcast (DDP:
``params_and_buffers_to_ignore``; a loader: load each rank's own shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.events import CollectiveEvent
from moedoctor.trace.params_format import (
    FOLDER,
    POINT_BEFORE_BROADCAST,
    POINT_PREPARED,
    POINT_STEP,
    Checkpoint,
    TensorPrint,
    read_folder,
)

PATTERN = "overwritten-shards"
REPLICATED_DIFFERS = "replicated-differs"
SHARD_IDENTICAL = "shard-identical"
STATE_DIFFERS = "optimizer-state-differs"
_REL = 1e-9


@dataclass
class Overwrite:
    """The collective that made the ranks' copies identical."""

    op: str
    src: int
    group: tuple[int, ...]
    call_site: str | None  # file:line (base name)
    call_path: str | None  # file:line (full path)
    phase: str | None
    step: int | None


@dataclass
class ParamFinding:
    kind: str  # REPLICATED_DIFFERS, SHARD_IDENTICAL, STATE_DIFFERS
    name: str
    point: str  # "prepared", "step 1"
    ranks: tuple[int, ...]  # the group compared
    differing: tuple[int, ...]  # ranks whose print differs from the first rank's (replicated); the group (identical)
    confidence: float
    evidence: str
    overwrite: Overwrite | None = None


@dataclass
class ParamsCheck:
    ranks: list[int]
    points: list[str]
    findings: list[ParamFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def pattern(self) -> str | None:
        return PATTERN if any(f.kind == SHARD_IDENTICAL for f in self.findings) else None

    @property
    def problem_found(self) -> bool:
        return bool(self.findings)

    def to_json(self) -> dict:
        def ow(o: Overwrite | None):
            return (
                None
                if o is None
                else {
                    "op": o.op,
                    "src": o.src,
                    "group": list(o.group),
                    "call_site": o.call_site,
                    "call_path": o.call_path,
                    "phase": o.phase,
                    "step": o.step,
                }
            )

        return {
            "pattern": self.pattern,
            "ranks": self.ranks,
            "points": self.points,
            "findings": [
                {
                    "kind": f.kind,
                    "name": f.name,
                    "point": f.point,
                    "ranks": list(f.ranks),
                    "differing": list(f.differing),
                    "confidence": f.confidence,
                    "evidence": f.evidence,
                    "overwrite": ow(f.overwrite),
                }
                for f in self.findings
            ],
            "notes": self.notes,
        }


def same(a: TensorPrint, b: TensorPrint) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return all(x == y or abs(x - y) <= _REL * max(abs(x), abs(y)) for x, y in zip(a.fingerprint, b.fingerprint))


def _all_same(prints: list[TensorPrint]) -> bool:
    return all(same(prints[0], p) for p in prints[1:])


def _differing(prints: dict[int, TensorPrint]) -> tuple[int, ...]:
    ranks = sorted(prints)
    return tuple(r for r in ranks[1:] if not same(prints[ranks[0]], prints[r]))


def _point_label(cp: Checkpoint) -> str:
    return f"step {cp.step}" if cp.point == POINT_STEP else cp.point


def has_params(path: Path) -> bool:
    return (Path(path) / FOLDER).is_dir()


def check_run_dir(path: Path, events: dict[int, list[CollectiveEvent]] | None = None) -> ParamsCheck:
    checkpoints, problems = read_folder(Path(path) / FOLDER)
    check = check_params(checkpoints, events or {})
    check.notes[:0] = [f"unreadable: {p}" for p in problems[:5]]
    return check


def check_params(checkpoints: dict[int, list[Checkpoint]], events: dict[int, list[CollectiveEvent]]) -> ParamsCheck:
    """Compare every rank's fingerprints; ``events`` (rank -> its collectives) attribute overwrites."""
    ranks = sorted(checkpoints)
    before: dict[str, dict[int, TensorPrint]] = {}
    points: dict[str, dict[int, Checkpoint]] = {}
    order: list[str] = []
    for rank, cps in checkpoints.items():
        for cp in cps:
            if cp.point == POINT_BEFORE_BROADCAST:
                for name, tp in cp.tensors.items():
                    before.setdefault(name, {})[rank] = tp
                continue
            label = _point_label(cp)
            if label not in points:
                order.append(label)
            points.setdefault(label, {})[rank] = cp
    order.sort(key=lambda label: (label != POINT_PREPARED, label))
    check = ParamsCheck(ranks=ranks, points=order)
    world = max((cp.world for cps in checkpoints.values() for cp in cps), default=len(ranks))
    if len(ranks) < 2:
        check.notes.append(f"fingerprints from {len(ranks)} rank(s) of {world}: nothing to compare")
        return check
    if len(ranks) < world:
        missing = sorted(set(range(world)) - set(ranks))
        check.notes.append(f"no fingerprints from rank(s) {','.join(map(str, missing))}: compared without them")

    # Plain parameters broadcast before the first forward: did they differ before, and did others agree?
    overwritten: dict[str, dict[int, TensorPrint]] = {}
    agreed_before = 0
    for name, prints in before.items():
        if len(prints) < 2:
            continue
        live = [p for p in prints.values() if not p.constant]
        if _all_same(list(prints.values())):
            # Constants (zeros, ones) say nothing: a rank's empty allocation is often zeros.
            agreed_before += bool(live)
        elif len(live) >= 2 and not _all_same(live):
            overwritten[name] = prints
    prepared = points.get(POINT_PREPARED, {})
    synced = {
        label: sum(1 for name in before if _kept_in_sync(_prints(at, name)))
        for label, at in points.items()
        if label != POINT_PREPARED
    }
    ctx = _Context(
        before, overwritten, agreed_before, _fsdp_sharded(prepared), events, prepared=prepared, synced=synced
    )
    reported: set[str] = set()
    for label in order:
        at = points[label]
        names = sorted({n for cp in at.values() for n in cp.tensors})
        for name in names:
            if name in reported:
                continue
            prints = _prints(at, name)
            if len(prints) < 2:
                continue
            finding = _compare(name, label, prints, at, ctx)
            if finding is not None:
                check.findings.append(finding)
                reported.add(name)
    prepared = points.get(POINT_PREPARED, {})
    plain = {n for cp in prepared.values() for n, tp in cp.tensors.items() if tp.layout is None}
    unclaimed = [n for n in overwritten if n not in reported and n in plain]  # FSDP2 shards: compared as such
    if unclaimed and not agreed_before:
        check.notes.append(
            f"{len(unclaimed)} parameter(s) differed across ranks before a broadcast made them identical, but so "
            "did every other broadcast parameter: the usual load-on-one-rank-then-broadcast, not claimed"
        )
    if ctx.per_rank:
        check.notes.append(
            f"{len(ctx.per_rank)} plain parameter(s) differ across ranks from the first point on and were never "
            "broadcast: taken as per-rank by construction (experts, pipeline stages: no DTensor says so), not compared"
        )
    if ctx.beside:
        check.notes.append(
            f"{len(ctx.beside)} plain parameter(s) were ones or zeros on every rank at the first forward and differ "
            "later, in modules that hold per-rank parameters: taken as per-rank too, not compared"
        )
    return check


@dataclass
class _Context:
    before: dict[str, dict[int, TensorPrint]]  # plain parameters' prints before their first broadcast
    overwritten: dict[str, dict[int, TensorPrint]]  # those that differed there (not only empty ranks)
    agreed_before: int  # broadcast parameters that already agreed before their broadcast
    fsdp_sharded: int  # parameters that are FSDP2 / DTensor shards at the first forward
    events: dict[int, list[CollectiveEvent]]
    per_rank: set[str] = field(default_factory=set)  # plain parameters that differ by construction
    prepared: dict[int, Checkpoint] = field(default_factory=dict)  # the first forward's prints
    synced: dict[str, int] = field(default_factory=dict)  # point -> broadcast parameters still identical there
    beside: set[str] = field(default_factory=set)  # constants at first in modules holding per-rank parameters


def _prints(at: dict[int, Checkpoint], name: str) -> dict[int, TensorPrint]:
    """rank -> the parameter's print at this point, for the ranks that have one."""
    return {r: cp.tensors[name] for r, cp in at.items() if name in cp.tensors}


def _kept_in_sync(prints: dict[int, TensorPrint]) -> bool:
    """The parameter is identical across the ranks at this point and not a constant (ones, zeros): the
    job keeps it in sync."""
    values = list(prints.values())
    return len(values) >= 2 and not all(p.constant for p in values) and _all_same(values)


def _fsdp_sharded(at: dict[int, Checkpoint]) -> int:
    names = {n for cp in at.values() for n, tp in cp.tensors.items() if tp.layout is not None}
    return sum(
        1
        for n in names
        if any(p.startswith("S") for cp in at.values() if n in cp.tensors for p in cp.tensors[n].layout.placements)
    )


def _compare(name: str, label: str, prints: dict[int, TensorPrint], cps: dict[int, Checkpoint], ctx: _Context):
    before, overwritten, per_rank, events = ctx.before, ctx.overwritten, ctx.per_rank, ctx.events
    base, _, state_key = name.partition("#")
    any_print = next(iter(prints.values()))
    layout = any_print.layout
    if state_key:
        param = {r: cp.tensors[base] for r, cp in cps.items() if base in cp.tensors}
        if base in per_rank or base in overwritten or len(param) < 2:
            return None
    if layout is not None:
        for placement, group in sorted({g for r in prints for g in layout.groups(r)}):
            members = {r: prints[r] for r in group if r in prints}
            if len(members) < 2:
                continue
            if placement == "R" and not _all_same(list(members.values())):
                if state_key and _differing({r: param[r] for r in members if r in param}):
                    continue  # the parameter itself differs: reported under its own name
                return ParamFinding(
                    STATE_DIFFERS if state_key else REPLICATED_DIFFERS,
                    name,
                    label,
                    tuple(sorted(members)),
                    _differing(members),
                    0.8,
                    f"a DTensor Replicate mesh dim: ranks {_fmt(members)} must hold the same local tensor",
                )
            if placement.startswith("S") and not state_key and _all_same(list(members.values())):
                if all(p.constant for p in members.values()):
                    continue  # shards of ones / zeros are identical and fine
                why = f"a DTensor {placement} mesh dim: ranks {_fmt(members)} hold identical, non-constant shards"
                return _identical(name, label, members, 0.75, why, _find_broadcast(events, members, None))
        return None
    # A plain tensor.
    if _differing(prints) and (desynced := _left_out_of_sync(name, label, ctx)) is not None:
        return desynced
    if name in overwritten:
        if not _all_same(list(prints.values())):
            return None
        extra = next(iter(overwritten[name].values())).extra
        said = (
            f"differed across ranks {_fmt(overwritten[name])} before its first broadcast (from rank {extra.get('src')})"
        )
        if ctx.agreed_before:
            score = 0.85
            why = f"{said} while {ctx.agreed_before} other broadcast parameter(s) already agreed"
        elif ctx.fsdp_sharded:
            score = 0.6  # lower: every broadcast parameter differed before (ranks waiting for rank 0's weights)
            why = (
                f"{said}, as every broadcast parameter did (lower: ranks waiting for rank 0's weights look the same), "
                f"but it is a plain tensor kept out of FSDP2 while {ctx.fsdp_sharded} parameter(s) are its shards: "
                "kept out of data parallelism, as expert-parallel parameters are"
            )
        else:
            return None
        why += ", and is identical after it: per-rank data overwritten"
        return _identical(name, label, prints, score, why, _find_broadcast(events, prints, overwritten[name]))
    if state_key:
        if _differing(param) or not _differing(prints):
            return None
        return ParamFinding(
            STATE_DIFFERS,
            name,
            label,
            tuple(sorted(prints)),
            _differing(prints),
            0.7,
            f"the parameter agrees across ranks {_fmt(prints)} at {label} but this optimizer state does not",
        )
    if not _differing(prints):
        return None
    if label == POINT_PREPARED or name in per_rank:
        if name not in before:
            per_rank.add(name)  # per-rank from the start, never synchronized
            return None
        why = "broadcast before the first forward, yet different across ranks after it"
    elif _constant_beside_per_rank(name, ctx):
        ctx.beside.add(name)  # e.g. a pipeline stage's LayerNorm: ones and zeros on every stage at first
        return None
    else:
        why = (
            "identical across ranks at the first forward, different after it (a plain tensor is taken as "
            "replicated over the world: lower if this parameter is meant to be per-rank)"
        )
    return ParamFinding(REPLICATED_DIFFERS, name, label, tuple(sorted(prints)), _differing(prints), 0.7, why)


def _constant_beside_per_rank(name: str, ctx: _Context) -> bool:
    """A parameter never broadcast that was a constant (ones, zeros) at the first forward, in a module
    (other than the root) that holds per-rank parameters: identical across ranks by its initialisation,
    which says nothing about being replicated."""
    if name in ctx.before:
        return False
    first = _prints(ctx.prepared, name).values()
    if not first or not all(p.constant for p in first):
        return False
    parts = name.split(".")[:-1]
    owners = {".".join(parts[:i]) + "." for i in range(1, len(parts) + 1)}
    return any(other.startswith(owner) for other in ctx.per_rank for owner in owners)


def _left_out_of_sync(name: str, label: str, ctx: _Context) -> ParamFinding | None:
    """A plain parameter that differed across ranks before its broadcast (an empty rank counts), was
    identical after it, and differs at a later step while other broadcast parameters are still
    identical there: the job keeps those in sync and not this one, so it is per-rank (as expert-
    parallel parameters are), and the broadcast overwrote it."""
    if label == POINT_PREPARED or name not in ctx.before or not ctx.synced.get(label):
        return None
    if _all_same(list(ctx.before[name].values())):
        return None  # the same on every rank before the broadcast: the broadcast changed nothing
    at_prep = _prints(ctx.prepared, name)
    if len(at_prep) < 2 or not _all_same(list(at_prep.values())):
        return None
    src = next(iter(ctx.before[name].values())).extra.get("src")
    why = (
        f"differed across ranks {_fmt(ctx.before[name])} before its broadcast (from rank {src}), identical after "
        f"it, and different again at {label} while {ctx.synced[label]} other broadcast parameter(s) are still "
        "identical there: the job keeps those in sync and not this one, so it is per-rank (as expert-parallel "
        "parameters are) and the broadcast overwrote it (lower: a replicated parameter that the gradient "
        "reduction leaves out looks the same)"
    )
    return _identical(name, POINT_PREPARED, at_prep, 0.6, why, _find_broadcast(ctx.events, at_prep, ctx.before[name]))


def _identical(name: str, label: str, group, score: float, evidence: str, overwrite) -> ParamFinding:
    ranks = tuple(sorted(group))
    return ParamFinding(SHARD_IDENTICAL, name, label, ranks, ranks, score, evidence, overwrite)


def _fmt(prints) -> str:
    return ",".join(map(str, sorted(prints)))


def _find_broadcast(
    events: dict[int, list[CollectiveEvent]], prints: dict[int, TensorPrint], before: dict[int, TensorPrint] | None
):
    """The recorded broadcast that wrote this tensor: on the recorded group from the recorded source
    with its local shape and dtype, nearest after the time each rank recorded before it (its own
    clock); without a record, the last such one."""
    some = next(iter(prints.values()))
    extra = next(iter(before.values())).extra if before else None
    src = extra.get("src") if extra else None
    group = tuple(sorted(extra["group"])) if extra and extra.get("group") else None
    for rank in sorted(prints, key=lambda r: r == src):  # a receiving rank's record first
        own = before.get(rank) if before else None
        target = (own.extra if own is not None else extra or {}).get("time")
        best = None
        for e in events.get(rank, ()):
            if e.op != "broadcast" or not e.in_shapes:
                continue
            bucket = tuple(e.in_shapes[0]) != some.shape or bool(e.dtypes and e.dtypes[0] != some.dtype)
            if bucket and (target is None or not 0 <= e.time - target <= 1.0):
                continue  # a flattened bucket (DDP's constructor, _broadcast_coalesced) counts only by time
            if src is not None and e.root is not None and e.root != src:
                continue
            if group is not None and tuple(sorted(e.group.ranks)) != group:
                continue
            if not set(prints) <= set(e.group.ranks):
                continue
            score = (bucket, e.time < target, abs(e.time - target)) if target is not None else (bucket, False, -e.time)
            if best is None or score < best[0]:
                best = (score, e)
        if best is not None:
            e = best[1]
            return Overwrite(
                "broadcast",
                e.root if e.root is not None else (src if src is not None else -1),
                tuple(e.group.ranks),
                e.call_site.short if e.call_site else None,
                e.call_site.where if e.call_site else None,
                e.phase.value if e.phase else None,
                e.step,
            )
    if extra:
        return Overwrite("broadcast", int(src) if src is not None else -1, group or (), None, None, None, None)
    return None
