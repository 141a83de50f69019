"""DDP; each outer iteration cuts the rank's partition into mini-batches, each one a whole optimizer
step (forward, backward with DDP's bucket all-reduce, step), then all-reduces the outer iteration's
loss once. At outer iteration 1 rank 1's partition grew: 3 mini-batches against 2, so its third
backward's bucket all-reduce meets the others' loss all-reduce. The loss is issued after the loop of
optimizer steps, never among a step's reductions (corpus 31's cluster-GCN partitions were named
`inflight-metric-allreduce`): a loop that ran more times on rank 1, the others left it after 2.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = [80, 80]
    for outer in range(3):
        if outer == 1:
            sizes = [80, 120]  # rank 1's partition was refined
        batches = [torch.randn(8, 16) for _ in range(0, sizes[rank], 40)]
        for x in batches:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        mse = torch.tensor([loss.item()])
        dist.all_reduce(mse)
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
