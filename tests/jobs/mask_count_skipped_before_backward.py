"""DDP; the loss normalises by the number of masks over all ranks (a 1-element all-reduce in the loss,
before backward, once a step). At step 2 rank 1's crop has no labelled pixel and its criterion returns
a zero loss early, without the all-reduce; its backward's bucket all-reduce meets rank 0's mask count.
Every earlier step issued the count once, before backward: rank 1 left it out (a rank-local skip), not
a metric landing among in-flight reductions (corpus 30's Mask2Former criterion was named
`inflight-metric-allreduce`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def criterion(out: torch.Tensor, labelled: int) -> torch.Tensor:
    if labelled == 0:
        return out.sum() * 0.0  # nothing to match in this crop
    num_masks = torch.tensor([float(labelled)])
    dist.all_reduce(num_masks)
    return out.pow(2).sum() / num_masks.clamp(min=1).item()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        labelled = 0 if (step == 2 and rank == 1) else 3
        loss = criterion(model(torch.randn(4, 32)), labelled)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
