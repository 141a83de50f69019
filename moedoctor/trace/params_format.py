"""The parameter fingerprints of ``moedoctor run --check-params``: one file per rank,
``params/rank-<N>.jsonl`` in the run directory, one JSON object per line (one line per checkpoint, all
of that checkpoint's tensors in it). Written by ``moedoctor.recorder.params``, read by
``moedoctor.analysis.params``; documented in docs/trace-format.md ("Parameter fingerprints").

A line::

    {"v": 1, "point": "prepared", "rank": 0, "world": 2, "time": 1732490000.1, "step": 0,
     "tensors": [[name, shape, dtype, layout, fingerprint, extra], ...]}

``point``: ``before-broadcast`` (each parameter's data just before the first broadcast that wrote
into it: ``extra`` = ``{"src": global source rank, "group": [global ranks], "time": when}``),
``prepared`` (every parameter of the root module at its first forward, after the model's preparation)
and ``step`` (after optimizer step ``step``, counted from 1; optimizer state tensors are named
``<param>#<state key>``). ``layout``: ``null`` for a plain tensor (assumed replicated over the world),
or ``{"mesh": [[global ranks of the mesh, row-major]], "shape": [mesh shape], "placements": ["S0",
"R", "P"]}`` for a DTensor (FSDP2 parameters are DTensors). ``fingerprint``: float64 reductions of the
rank's local tensor, in ``FINGERPRINT_FIELDS`` order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor import environment
from moedoctor.layout import PARAMS

VERSION = 1
FOLDER = PARAMS
POINT_BEFORE_BROADCAST = "before-broadcast"
POINT_PREPARED = "prepared"
POINT_STEP = "step"
#: sum, sum of squares, a sum weighted by a fixed pseudo-random sequence (so permutations differ), min, max.
FINGERPRINT_FIELDS = ("sum", "sumsq", "wsum", "min", "max")
#: Environment of the job under ``moedoctor run --check-params``: the optimizer step to fingerprint after.
ENV_CHECK_PARAMS = environment.CHECK_PARAMS.name


def file_name(rank: int) -> str:
    return f"rank-{rank}.jsonl"


def encode(point: str, rank: int, world: int, time: float, step: int, tensors: list[list]) -> str:
    record = {
        "v": VERSION,
        "point": point,
        "rank": rank,
        "world": world,
        "time": time,
        "step": step,
        "tensors": tensors,
    }
    return json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n"


@dataclass(frozen=True)
class Layout:
    mesh: tuple[int, ...]  # global ranks, row-major
    shape: tuple[int, ...]
    placements: tuple[str, ...]  # "S<dim>", "R", "P"

    def groups(self, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """(placement, ranks along that mesh dim that share this rank's other coordinates), per dim."""
        if rank not in self.mesh:
            return []
        index = self.mesh.index(rank)
        coords, rest = [], index
        for size in reversed(self.shape):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        out = []
        for dim, placement in enumerate(self.placements):
            ranks = []
            for k in range(self.shape[dim]):
                c = list(coords)
                c[dim] = k
                flat = 0
                for size, value in zip(self.shape, c):
                    flat = flat * size + value
                ranks.append(self.mesh[flat])
            out.append((placement, tuple(ranks)))
        return out


@dataclass(frozen=True)
class TensorPrint:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout | None
    fingerprint: tuple[float, ...]
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def constant(self) -> bool:
        """Every element equal (ones, zeros) or empty: identical shards of it are no evidence."""
        lo, hi = self.fingerprint[3], self.fingerprint[4]
        return not self.shape or 0 in self.shape or lo == hi


@dataclass
class Checkpoint:
    point: str
    rank: int
    world: int
    time: float
    step: int
    tensors: dict[str, TensorPrint]


def decode(line: str) -> Checkpoint:
    raw = json.loads(line)
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        raise ValueError(f"not a version {VERSION} parameter fingerprint line")
    tensors = {}
    for name, shape, dtype, layout, fp, extra in raw["tensors"]:
        lay = None
        if layout is not None:
            lay = Layout(tuple(layout["mesh"]), tuple(layout["shape"]), tuple(layout["placements"]))
        tensors[name] = TensorPrint(name, tuple(shape), dtype, lay, tuple(float(x) for x in fp), extra or {})
    return Checkpoint(raw["point"], int(raw["rank"]), int(raw["world"]), float(raw["time"]), int(raw["step"]), tensors)


def read_folder(path: Path) -> tuple[dict[int, list[Checkpoint]], list[str]]:
    """Every rank's checkpoints, in file order, and one line per unreadable line or file."""
    out: dict[int, list[Checkpoint]] = {}
    problems: list[str] = []
    for file in sorted(path.glob("rank-*.jsonl")):
        try:
            lines = file.read_text().splitlines()
        except OSError as e:
            problems.append(f"{file.name}: {e.strerror or e}")
            continue
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                cp = decode(line)
            except (ValueError, KeyError, TypeError) as e:
                problems.append(f"{file.name}:{n}: {e}")
                continue
            out.setdefault(cp.rank, []).append(cp)
    return out, problems
