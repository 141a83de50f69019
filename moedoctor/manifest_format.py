"""``manifest.json``'s format: its keys, and the one reader of the file (``Manifest``).

The file is written by one writer, ``runner/manifest.py`` (``write_node``: each node's entry under
``nodes``, the top-level keys recomputed from all entries under a lock), with the keys below; it is
read only through ``Manifest`` here, whatever the layer (the analysis, verification, the runner, the
CLI). ``tests/unit/test_owners.py`` fails on a manifest read as a raw dict anywhere else. A shared
leaf: no torch, nothing above ``run_records``.

Top-level keys (``Key``): ``format``, ``version``, ``command``, ``moedoctor_version``,
``torch_version``, ``python_version``, ``recorder``, ``fixes``, ``env``, ``nodes`` (node name -> the node's entry,
``runner.manifest.NodeRecord``), ``world_size``, ``hosts``, ``start``, ``end``, ``status``,
``ranks`` (rank -> ``RankExit``), ``hang`` (``HangRecord``), ``busy`` (``BusyRecord`` list),
``coverage`` (``{complete, gaps}``), ``trace_problems``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moedoctor.run_records import BusyRecord, HangRecord, LastCollective, RankAtHang, busy_of

FORMAT = "moedoctor-manifest"
VERSION = 1


class Key:
    """The manifest's top-level keys."""

    FORMAT = "format"
    VERSION = "version"
    COMMAND = "command"
    ENV = "env"
    NODES = "nodes"
    WORLD_SIZE = "world_size"
    HOSTS = "hosts"
    START = "start"
    END = "end"
    STATUS = "status"
    RANKS = "ranks"
    HANG = "hang"
    BUSY = "busy"
    COVERAGE = "coverage"
    TRACE_PROBLEMS = "trace_problems"
    MOEDOCTOR_VERSION = "moedoctor_version"
    TORCH_VERSION = "torch_version"
    PYTHON_VERSION = "python_version"  # of the moedoctor process that ran the job, as torch_version
    RECORDER = "recorder"  # the recording kernel the run used
    FIXES = "fixes"  # the fixes injected


class NodeKey:
    """The keys of one node's entry under ``nodes`` (``runner.manifest.NodeRecord``'s fields)."""

    NODE = "node"
    HOST = "host"
    MOEDOCTOR_PID = "moedoctor_pid"
    START = "start"
    END = "end"
    STATUS = "status"
    LAUNCHER_EXIT = "launcher_exit"
    RANKS = "ranks"
    HANG = "hang"
    BUSY = "busy"


class HangKey:
    """The keys of the hang record the writer merges across nodes (``HangRecord``'s fields)."""

    DETECTED_AT = "detected_at"
    RANKS = "ranks"
    GPU_FILE = "gpu_file"
    GPU_FILES = "gpu_files"  # the merged record: every node's NVML snapshot
    STACK_FILE = "stack_file"  # in each rank's entry
    RANK = "rank"  # in each rank's entry


class Status:
    """How a node's run (and the run as a whole) stands or ended (``status``)."""

    RUNNING = "running"
    FINISHED = "finished"  # the job ended by itself (whatever its exit status)
    HANG = "hang"  # a hang was detected (and the job stopped unless --keep-alive)
    INTERRUPTED = "interrupted"  # moedoctor was interrupted and stopped the job


#: Every top-level key, for the owners test.
KEYS = frozenset(v for k, v in vars(Key).items() if not k.startswith("_"))


def load_manifest(path: Path) -> dict:
    """The manifest as written (JSON). OSError, ValueError (not JSON), RecursionError (nested past
    the parser's limit) as ``json`` raises them. Only ``Manifest`` and the writer use it."""
    return json.loads(Path(path).read_text())


def hang_of(manifest: dict) -> HangRecord | None:
    """A manifest document's hang record, typed (None without one)."""
    raw = manifest.get(Key.HANG)
    if not raw:
        return None
    ranks = [RankAtHang(**{**r, "last": LastCollective(**r["last"]) if r.get("last") else None}) for r in raw["ranks"]]
    fields = {k: raw[k] for k in ("detected_at", "host", "hang_timeout", "idle_seconds", "stopped")}
    return HangRecord(
        **fields,
        ranks=ranks,
        gpu_file=raw.get("gpu_file"),
        trigger=raw.get("trigger", "hang"),
        finding=raw.get("finding"),
        detection_latency_s=raw.get("detection_latency_s"),
        lags=list(raw.get("lags") or ()),
        proof=raw.get("proof"),
        mechanism=raw.get("mechanism"),
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Manifest:
    """``manifest.json`` as read: typed accessors over the document (each checks the type of what it
    returns: a damaged manifest gives None or empty, never an exception, except ``hang``)."""

    doc: dict = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """The manifest at ``path``: OSError (FileNotFoundError when absent), ValueError (not JSON,
        or not a JSON object), RecursionError as the JSON parser raises them."""
        doc = load_manifest(path)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        return cls(doc)

    @classmethod
    def read_or_empty(cls, path: Path) -> Manifest:
        """The manifest at ``path``, or an empty one where it cannot be read (not written yet)."""
        try:
            return cls.read(path)
        except (OSError, ValueError, RecursionError):
            return cls({})

    def raw(self, key: str) -> object:
        """A top-level value as written (for the readers that check it themselves)."""
        return self.doc.get(key)

    @property
    def status(self) -> str | None:
        status = self.doc.get(Key.STATUS)
        return status if isinstance(status, str) else None

    @property
    def command(self) -> list | None:
        """The launch command as written (a list; its items unchecked), None if not a list."""
        command = self.doc.get(Key.COMMAND)
        return command if isinstance(command, list) else None

    @property
    def world_size(self) -> int | None:
        world = self.doc.get(Key.WORLD_SIZE)
        return world if _is_int(world) else None

    @property
    def python_version(self) -> str | None:
        """The Python version of the moedoctor process that ran the job (``3.11.9``), when recorded."""
        version = self.doc.get(Key.PYTHON_VERSION)
        return version if isinstance(version, str) else None

    @property
    def recorder(self) -> str | None:
        """The recording kernel the run used (``native``, ``python``), when recorded."""
        recorder = self.doc.get(Key.RECORDER)
        return recorder if isinstance(recorder, str) else None

    @property
    def nodes(self) -> dict[str, dict]:
        """Each node's entry (entries that are not objects left out)."""
        nodes = self.doc.get(Key.NODES)
        return {k: v for k, v in nodes.items() if isinstance(v, dict)} if isinstance(nodes, dict) else {}

    @property
    def nodes_raw(self) -> object:
        """``nodes`` as written (the analysis bounds and checks it entry by entry)."""
        return self.doc.get(Key.NODES)

    @property
    def ranks(self) -> object:
        """``ranks`` as written: ``{rank: RankExit's fields}`` (the readers check each entry)."""
        return self.doc.get(Key.RANKS)

    @property
    def coverage(self) -> dict | None:
        coverage = self.doc.get(Key.COVERAGE)
        return coverage if isinstance(coverage, dict) else None

    @property
    def busy(self) -> list[BusyRecord]:
        return busy_of(self.doc.get(Key.BUSY))

    @property
    def hang(self) -> HangRecord | None:
        """The hang record, typed; raises (KeyError, TypeError, ...) on a damaged one."""
        return hang_of(self.doc)

    def node_running_elsewhere(self, here: str) -> bool:
        """A node of the manifest still running on a host other than ``here``."""
        return any(
            n.get(NodeKey.STATUS) == "running" and n.get(NodeKey.HOST) not in (None, here) for n in self.nodes.values()
        )

    def unknown_exit_ranks(self) -> list[int]:
        """The ranks whose exit status cannot be known (``RankExit.source`` ``unknown``); ValueError,
        TypeError, KeyError or AttributeError on a damaged entry."""
        entries = list((self.doc.get(Key.RANKS) or {}).values())
        return sorted(int(e["rank"]) for e in entries if e.get("source") == "unknown")
