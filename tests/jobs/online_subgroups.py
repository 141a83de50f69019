"""A 4-rank job (Gloo) with several process groups; with ``--desync-step N`` one pair's group desyncs.

Groups: the world, a pair per two ranks (0,1) and (2,3), the even and the odd ranks. Each step issues
collectives on all of them (one async batch on the world). At step ``--desync-step`` rank 3 issues an
all_gather on its pair's group where rank 2 issues an all_reduce (the two block, as in the fixtures);
the other ranks go on to the next world collective and wait there. Without it the job is healthy.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--desync-step", type=int, default=-1)
    parser.add_argument("--pg-timeout", type=float, default=60)
    parser.add_argument("--sleep", type=float, default=0.02)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run with --nproc_per_node=4"
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    parity = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair, par = pairs[rank // 2], parity[rank % 2]
    for step in range(args.steps):
        works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(3)]
        for w in works:
            w.wait()
        dist.all_reduce(torch.ones(8), group=par)
        if step == args.desync_step and rank == 3:
            dist.all_gather_into_tensor(torch.zeros(2 * 272), torch.ones(272), group=pair)
            sys.stdout.write(f"[rank {rank}] desync issued at {time.time():.6f}\n")
        else:
            dist.all_reduce(torch.ones(8), group=pair)
        dist.broadcast(torch.zeros(16), src=0)
        dist.all_gather_into_tensor(torch.zeros(2 * 6), torch.ones(6), group=pair)
        time.sleep(args.sleep)
    dist.barrier()
    sys.stdout.write(f"[rank {rank}] done\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
