"""Completed ops' Works still held by the native kernel while the interpreter exits, released by daemon
threads that poll it (as the recorder's progress thread does when its join at close timed
out). Each Work holds the last reference to its tensor, whose Python object outlived the job's own
reference: destroying it lets go of the GIL and takes it back (THPVariable_clear), and a daemon
thread that takes the GIL back while the interpreter finalizes is ended there, inside a destructor:
"terminate called without an active exception", SIGABRT after the job finished. The process must
exit 0 (the kernel leaves the Works alive once the recorder's last exit handler ran).

The Works are Gloo send/recv ones: they have no future, so the kernel holds them and asks them
isCompleted() (as it does NCCL's); a collective's Gloo Work reports through its CPU future instead,
and the kernel keeps no reference to it. Two ranks of one process-local group, in this process.

Run with the recorder installed (``MOEDOCTOR_RUN_DIR``, ``MOEDOCTOR_NATIVE=1``); exits 3 without it.
"""

import atexit
import sys
import threading
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from moedoctor.recorder.install import installed_recorder  # noqa: E402

recorder = installed_recorder()
if recorder is None or recorder._native is None:
    sys.exit(3)
recorder._progress.idle = True  # the Works stay in the kernel for the threads below
module = recorder._native._m
go = threading.Event()


def poll() -> None:
    go.wait()
    while True:
        module.poll()


for _ in range(4):
    threading.Thread(target=poll, daemon=True).start()


def pair_group(rank: int) -> dist.ProcessGroup:
    """Rank ``rank`` of a 2-rank Gloo group, built as torch builds one (its ops go through the
    dispatcher, where the kernel records them)."""
    group = dist.ProcessGroup(pair_store, rank, 2)
    backend = dist.ProcessGroupGloo(pair_store, rank, 2)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    groups[rank] = group
    return group


pair_store = dist.HashStore()
groups: dict[int, dist.ProcessGroup] = {}
builders = [threading.Thread(target=pair_group, args=(rank,)) for rank in (0, 1)]
for builder in builders:
    builder.start()
for builder in builders:
    builder.join()


@atexit.register  # after the recorder's: runs before its exit handlers
def release_while_exiting() -> None:
    works = []
    for tag in range(1500):
        t = torch.ones(256)
        works.append(groups[1].recv([torch.empty(256)], 0, tag))
        works.append(groups[0].send([t], 1, tag))
        t.add_(1)  # the job's own use; its reference goes at the next iteration
    for w in works:
        w.wait()
    del works
    # Gloo's send/recv Works never say isCompleted(): counted complete, so that the polls release them.
    module.set_assume_completed(True)
    go.set()
    time.sleep(0.002)


print("exiting", flush=True)
sys.exit(0)
