"""Two process groups over the same two ranks; each step all-reduces gradients on one and targets on
the other. The order is written twice, in both arms of an ``if`` on the rank's own queue length: a
full queue flushes the targets first. Rank 1's queue fills faster and is full at step 2, so rank 1
waits on the targets group while rank 0 waits on the gradients group: a cycle. The collective rank 1
is blocked in comes from a line rank 0 never ran, but it is the same call as the one every step ran
from the other arm: a reordering, not a collective that only some ranks issue.
"""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    grads_group = dist.new_group([0, 1])
    targets_group = dist.new_group([0, 1])
    queue = 0
    for step in range(5):
        queue += 1 if rank == 0 else 3
        grads, targets = torch.ones(64), torch.ones(5)
        if queue >= 7:
            dist.all_reduce(targets, group=targets_group)
            dist.all_reduce(grads, group=grads_group)
            queue = 0
        else:
            dist.all_reduce(grads, group=grads_group)
            dist.all_reduce(targets, group=targets_group)
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
