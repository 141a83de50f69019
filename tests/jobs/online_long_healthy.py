"""A long healthy job for the online detector: tens of thousands of small collectives (Gloo) on
several groups, async ops, p2p in both directions and a collective from a second thread.

Per step: 2 async all_reduces and a sync one on the world, an all_gather and a broadcast on a second
group of every rank, a reduce_scatter-like all_to_all on a third, a send/recv exchange through
batch_isend_irecv (both directions: the order may differ across the pair), and every 50 steps an
all_gather_object and a barrier. Prints how many collectives each rank issued.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2500)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = list(range(world))
    second, third = dist.new_group(everyone), dist.new_group(everyone)
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    t = torch.ones(4)
    start = time.monotonic()
    issued = 0
    for step in range(args.steps):
        works = [dist.all_reduce(t.clone(), async_op=True), dist.all_reduce(t.clone(), async_op=True)]
        dist.all_reduce(torch.ones(2))
        for w in works:
            w.wait()
        dist.all_gather_into_tensor(torch.zeros(world * 3), torch.ones(3), group=second)
        dist.broadcast(torch.zeros(5), src=step % world, group=second)
        dist.all_reduce(torch.ones(1, dtype=torch.float64), op=dist.ReduceOp.MAX, group=third)
        issued += 6
        if world > 1:
            out, inp = torch.zeros(3), torch.full((3,), float(rank))
            ops = [dist.P2POp(dist.isend, inp, peer_next), dist.P2POp(dist.irecv, out, peer_prev)]
            if rank % 2:
                ops.reverse()
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        if step % 50 == 49:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, {"rank": rank, "step": step})
            background = threading.Thread(target=lambda: dist.all_reduce(torch.ones(2), group=third))
            background.start()
            background.join()
            dist.barrier(group=second)
            issued += 3
    dist.barrier()
    sys.stdout.write(f"[rank {rank}] healthy: {args.steps} steps, about {issued} collectives "
                     f"in {time.monotonic() - start:.1f}s\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
