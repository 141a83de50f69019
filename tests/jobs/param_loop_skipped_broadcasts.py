"""A hand-rolled ZeRO-1 step: gradients all-reduced one parameter at a time, then each parameter
broadcast from the rank that owns it. No torch optimizer (the step counter never advances). At step 3
rank 1 finds its own partition's gradient norm not finite and skips the step, broadcasts included,
going straight on to the next step's gradient all-reduces, while rank 0 waits in the broadcasts.
Every earlier pass over the parameters issued the same items and then a broadcast: rank 1 began the
next pass, skipping the broadcasts (a skipped collective), not a longer loop of all-reduces.
"""

import math
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    params = list(model.parameters())
    for step in range(6):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        for p in params:
            dist.all_reduce(p.grad)  # one parameter at a time
        mine = [p for i, p in enumerate(params) if i % world == rank]
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in mine))
        if step == 3 and rank == 1:
            norm = math.inf  # an overflow seen on this rank's own partition only
        if math.isfinite(norm):
            with torch.no_grad():
                for p in mine:
                    p -= 0.01 * p.grad
            for i, p in enumerate(params):
                dist.broadcast(p.data, src=i % world)  # the owner's update to everyone
        for p in params:
            p.grad = None
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
