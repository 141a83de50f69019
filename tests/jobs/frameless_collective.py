"""A collective issued by a thread that has a Python thread state but no Python frame: each rank starts
``ProcessGroup.allreduce`` (a builtin) with ``_thread.start_new_thread``, so the thread calls it straight
from C, as DDP's reducer does from an autograd device thread. Then an ordinary all_reduce and a barrier
from the main thread. Prints ``frameless ok <value>`` when the first all-reduce's result arrived.

  torchrun --nproc_per_node 2 tests/jobs/frameless_collective.py
"""

from __future__ import annotations

import _thread
import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    tensor = torch.ones(4)
    _thread.start_new_thread(world.allreduce, ([tensor],))  # no Python frame on that thread
    deadline = time.monotonic() + 30
    while tensor[0].item() != dist.get_world_size() and time.monotonic() < deadline:
        time.sleep(0.01)
    value = tensor[0].item()
    follow = torch.ones(2)
    dist.all_reduce(follow)
    dist.barrier()
    print(f"frameless {'ok' if value == dist.get_world_size() else 'missing'} {value:g}", flush=True)
    dist.destroy_process_group()
