"""A plain loop that all-reduces gradients once per micro-batch, where the ranks run different
numbers of micro-batches in one step (no checkpoint, no DTensor, no gather): at step 2 rank 0 runs
3 micro-batches and rank 1 runs 4. Rank 0 goes on to the step's loss all-reduce while rank 1 is
still in the loop; Gloo waits until the process-group timeout. The mechanism is a loop trip count
that differs across ranks; no checkpoint pattern may be named for it (issue 28's first example).
"""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        micro_batches = 4 if (step == 2 and rank == 1) else 3  # a data-dependent count, decided locally
        total = torch.zeros(1)
        for _ in range(micro_batches):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)  # once per micro-batch
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)  # the step's loss
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
