"""A quiet job: one all_reduce, a line on stdout, then every rank sleeps silently for a long time
(no output, no collective). Used to kill moedoctor under it and check that nothing survives."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=600))
dist.all_reduce(torch.ones(1))
print(f"[rank {dist.get_rank()}] sleeping", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
dist.destroy_process_group()
os._exit(0)
