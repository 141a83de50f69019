"""Rank 1 all-reduces a tensor of another size at the third collective: Gloo aborts a rank (SIGABRT)
within milliseconds. The aborted rank's trace must still hold that collective."""

import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
rank = dist.get_rank()
for _ in range(2):
    dist.all_reduce(torch.ones(4))
dist.all_reduce(torch.ones(4 if rank == 0 else 1))  # the mismatch
dist.barrier()
dist.destroy_process_group()
