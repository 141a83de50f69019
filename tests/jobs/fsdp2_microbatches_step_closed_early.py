"""FSDP2, token-budget packing: each step first all-reduces the rank's token count (one element), then
runs the rank's micro-batches (forward all-gathers, backward reduce-scatters) and steps the
optimizer. At step 2 rank 0 packs 3 micro-batches and rank 1 packs 2: rank 1 steps, begins step 3
and all-reduces its token count while rank 0 all-gathers for its third micro-batch. The small
all-reduce meets an FSDP all-gather, as an in-flight metric would, but the ranks are in different
steps (rank 1's optimizer step moved its counter): one closed the step while the other ran another
micro-batch, no metric among reductions (corpus 30's DeepSeek-V3 packing was named
`inflight-metric-allreduce`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        micro = 3 if (step == 2 and rank == 0) else 2  # what the rank's documents packed into
        tokens = torch.tensor([float(micro * 64)])
        dist.all_reduce(tokens)  # the step's token count, for the loss's normalisation
        for _ in range(micro):
            loss = model(torch.randn(8, 16)).pow(2).sum() / tokens.item()
            loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
