"""Which processes of a launch are its ranks on this node, whatever started them.

Under torchrun every worker carries ``RANK`` in its environment from the start. Under any other
command (``python train.py`` that calls ``mp.spawn``, ``accelerate launch``, Lightning's launcher, a
Ray driver whose actors set ``RANK`` in ``os.environ`` at run time, which ``/proc/PID/environ``
never shows) a process becomes a rank when it creates its default process group: the recorder then
writes its trace, whose header holds the rank, the world size, the host and the pid that
torch.distributed gave it. So the ranks are read from the traces first: a trace of this host whose
pid is a process of this launch (the root's descendants, or a process carrying the launch's marker:
Ray's workers are children of its raylet, not of the driver). ``RANK`` in the environment only
names the ranks that have no trace yet (torchrun's workers stuck before ``init_process_group``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moedoctor.manifest_format import Manifest
from moedoctor.run_records import RankExit
from moedoctor.runner import procs
from moedoctor.runner.progress import RankProgress


def local_ranks(
    root_pid: int, marker: tuple[str, str], traced: Mapping[int, RankProgress], host: str
) -> dict[int, procs.JobProcess]:
    """The rank processes of this launch on this host, by rank: from the traces (torch.distributed's
    own rank), then from ``RANK`` in the environment for the ranks not traced yet."""
    processes = procs.job_processes(root_pid, marker)
    return ranks_of(processes, traced, host)


def ranks_of(
    processes: list[procs.JobProcess], traced: Mapping[int, RankProgress], host: str
) -> dict[int, procs.JobProcess]:
    """``local_ranks`` on a list of the launch's processes (``procs.job_processes``)."""
    by_pid = {p.pid: p for p in processes}
    ranks: dict[int, procs.JobProcess] = {}
    for rank, t in sorted(traced.items()):
        p = by_pid.get(t.pid)
        if t.host != host or p is None:
            continue  # another node's rank (a shared run directory), or gone
        ranks[rank] = procs.JobProcess(p.pid, p.ppid, rank, t.local_rank, t.world_size)
    taken = {p.pid for p in ranks.values()}
    for rank, p in procs.rank_processes(processes).items():
        if rank not in ranks and p.pid not in taken:
            ranks[rank] = p
    return ranks


def rank_exits(
    seen: Mapping[int, procs.JobProcess],
    root_pid: int | None,
    root_exit: int | None,
    torchrun: bool,
    torchrun_failures: Mapping[int, int],
    host: str,
    first_failure: int | None = None,
) -> list[RankExit]:
    """How each rank seen on this node ended, and how we know (``RankExit.source``). Under torchrun:
    its exit 0 means every rank's, its failure report gives the failed ones'. Under any other command
    only a rank that is the root itself has a known status (``root``); the others' are ``unknown``:
    their parent (``mp.spawn``, a raylet) reaped them, and its own exit status says nothing certain
    about each of them. ``first_failure``: the rank torchrun named the root cause of a failed job."""
    exits = []
    for rank, p in sorted(seen.items()):
        if root_exit is None:
            code, source = None, "stopped"
        elif p.pid == root_pid:
            code, source = root_exit, "root"
        elif not torchrun:
            code, source = None, "unknown"
        elif root_exit == 0:
            code, source = 0, "launcher"
        elif rank in torchrun_failures:
            code, source = torchrun_failures[rank], "torchrun"
        else:
            code, source = None, "unknown"
        exits.append(RankExit(rank, host, p.pid, p.local_rank, code, source, rank == first_failure))
    return exits


def unknown_exits_line(manifest: Path) -> str | None:
    """One line for the report when the manifest's ranks include some whose exit status cannot be
    known (``RankExit.source`` ``unknown``), else None."""
    try:
        unknown = Manifest.read(Path(manifest)).unknown_exit_ranks()
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not unknown:
        return None
    return (
        f"the exit status of rank{'s' if len(unknown) > 1 else ''} {','.join(map(str, unknown))} is not known: "
        "the command is not torchrun (or torchrun's failure report does not name it), and the process that "
        "reaped it (mp.spawn, a raylet, a launcher) does not report it"
    )
