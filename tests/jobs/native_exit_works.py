"""Completed collectives' Works still held by the native kernel while the interpreter exits, released
by daemon threads that poll it (as the recorder's progress thread does when its join at close timed
out). Each Work holds the last reference to its tensor, whose Python object outlived the job's own
reference: destroying it lets go of the GIL and takes it back (THPVariable_clear), and a daemon
thread that takes the GIL back while the interpreter finalizes is ended there, inside a destructor:
"terminate called without an active exception", SIGABRT after the job finished. The process must
exit 0 (the kernel leaves the Works alive once the recorder's last exit handler ran).

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


@atexit.register  # after the recorder's: runs before its exit handlers
def release_while_exiting() -> None:
    works = []
    for _ in range(3000):
        t = torch.ones(256)
        works.append(dist.all_reduce(t, async_op=True))
        t.add_(1)  # the job's own use; its reference goes at the next iteration
    for w in works:
        w.wait()
    del works
    go.set()
    time.sleep(0.002)


print("exiting", flush=True)
sys.exit(0)
