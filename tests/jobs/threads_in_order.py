"""Several threads recording at once, each on a group of its own (so Gloo pairs each thread's collectives
across ranks): ``--threads`` threads x ``--count`` all_reduces, then a barrier. With call-site cache hits
recorded without the GIL, the threads are inside the kernel together; their records must still reach
the trace in the order of their event ids (tests/integration/test_native_recorder.py). Prints
``threads ok``.

  torchrun --nproc_per_node 2 tests/jobs/threads_in_order.py [--threads 3] [--count 300]
"""

from __future__ import annotations

import argparse
import threading

import torch
import torch.distributed as dist


def issue(group, count: int) -> None:
    tensor = torch.ones(8)
    for _ in range(count):
        dist.all_reduce(tensor, group=group)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    groups = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(args.threads)]
    workers = [threading.Thread(target=issue, args=(group, args.count)) for group in groups]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    dist.barrier()
    print("threads ok", flush=True)
    dist.destroy_process_group()
