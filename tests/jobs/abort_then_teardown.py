"""Rank 1 aborts (SIGABRT) after two all-reduces, as Gloo aborts a rank on a size mismatch; rank 0 is
busy elsewhere (not in a collective, so nothing makes it fail by itself) until torchrun, seeing rank 1
gone, stops it with SIGTERM. The run's exit statuses: rank 1 -6, rank 0 -15."""

import datetime
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
for _ in range(2):
    dist.all_reduce(torch.ones(4))
if dist.get_rank() == 1:
    os.abort()
time.sleep(60)
dist.destroy_process_group()
