"""Reading one rank's trace file whole (``read_rank_trace``) or record by record (``TraceFolder``, for
the streaming path of ``analysis.loading.scan``), and the last sequence numbers the traces reached.

Below both ``analysis.loading.load`` (which opens a run) and ``analysis.loading.scan`` (which streams a large one),
so that neither imports the other at run time.
"""

from __future__ import annotations

from pathlib import Path

from moedoctor.errors import reading
from moedoctor.trace.reader import MAX_HEADER_BYTES, MAX_RECORD_BYTES, RankTrace, TraceError, TraceFile, fold
from moedoctor.trace.schema import MAX_STRING


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# ---- traces -------------------------------------------------------------------------------------


def read_rank_trace(path: Path, incomplete: list[str]) -> RankTrace | None:
    """One rank's trace, tolerant of any damage: every record that does not parse or does not
    type-check is skipped and noted. Returns None (noted) for a file that is not a readable
    moedoctor trace at all."""
    try:
        tf = TraceFile(path)
        f = open(tf.path, "rb")
    except (TraceError, OSError, ValueError) as e:
        incomplete.append(f"{Path(path).name}: left out: {e}")
        return None
    folder = TraceFolder(tf)
    with f, reading(path):
        offset = len(f.readline(MAX_HEADER_BYTES + 1))
        for line in _bounded_lines(f):
            if not folder.feed(line, offset):
                break
            offset += len(line)
        trace = folder.finish()
    incomplete.extend(trace.problems)
    return trace


def _bounded_lines(f, limit: int = MAX_RECORD_BYTES):
    """The file's lines; one longer than ``limit`` is not held in memory: it comes back as its first
    ``limit + 1`` bytes (which the parser refuses as over the cap) and the rest is skipped."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            rest = f.readline(1 << 20)
            while rest and not rest.endswith(b"\n"):
                rest = f.readline(1 << 20)
            # keep the line ending (a whole record, refused for its size), not the bytes
            line = line + b"\n" if rest else line
        yield line


class TraceFolder:
    """Folds records, line by line, into a ``RankTrace``: completions and annotations into their
    events. Every line is type-checked; a bad one costs that line only."""

    MAX_NOTED = 3

    def __init__(self, tf: TraceFile):
        self.tf = tf
        self.trace = RankTrace(path=tf.path, header=tf.header, problems=list(tf.problems))
        self.index: dict[int, int] = {}
        self.bad = 0

    def feed(self, line: bytes, offset: int) -> bool:
        """Add one line; False when it is a truncated last line (stop reading)."""
        if not line.endswith(b"\n"):
            self.trace.problems.append(f"{self.tf.path.name}: last record truncated (byte {offset})")
            return False
        try:
            item = self.tf.parse_line(line)  # type-checked by the schema
        except Exception as e:  # noqa: BLE001 - any damage in one record costs that record only
            self.bad += 1
            if self.bad <= self.MAX_NOTED:
                self.trace.problems.append(f"{self.tf.path.name}: corrupt record at byte {offset} ({type(e).__name__})")
            return True
        if item is not None:
            fold(self.trace, self.index, item)
        return True

    def finish(self) -> RankTrace:
        if self.bad > self.MAX_NOTED:
            self.trace.problems.append(f"{self.tf.path.name}: {self.bad - self.MAX_NOTED} more corrupt records")
        self.trace.groups = {g.name: g for g in self.tf.groups.values()}
        self.trace.capped = self.tf.capped
        return self.trace


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str(x) -> bool:
    return isinstance(x, str) and len(x) <= MAX_STRING


def last_sequences(traces: list[RankTrace]) -> tuple[dict[int, dict[str, int]], dict[int, dict[tuple[str, int], int]]]:
    last_seq: dict[int, dict[str, int]] = {}
    last_p2p: dict[int, dict[tuple[str, int], int]] = {}
    for t in traces:
        seqs: dict[str, int] = {}
        p2p: dict[tuple[str, int], int] = {}
        for g in t.groups:
            seqs.setdefault(g, 0)
        for e in t.events:
            if e.is_p2p:
                if e.peer is not None and e.p2p_seq is not None:
                    key = (e.group.name, e.peer)
                    p2p[key] = max(p2p.get(key, 0), e.p2p_seq)
            else:
                seqs[e.group.name] = max(seqs.get(e.group.name, 0), e.seq)
        last_seq[t.rank], last_p2p[t.rank] = seqs, p2p
    return last_seq, last_p2p


# ---- manifest, stacks, GPU ----------------------------------------------------------------------
