"""A hand-rolled sharded optimizer: gradients all-reduced one parameter at a time, then the updated
flat shards all-gathered (``all_gather_into_tensor``) outside any save. No torch optimizer. At step 3
rank 1's own loss-spike guard skips the step, gather included, and it goes straight on to the next
step's gradient all-reduces while rank 0 waits in the gather. Every earlier pass issued the same
items and then the gather: rank 1 skipped what follows the loop. The gather at the divergence is the
step's own collective, not a walk over a state's keys, so no checkpoint pattern may be named.
"""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    chunk = (n + world - 1) // world
    for step in range(6):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        for p in params:
            dist.all_reduce(p.grad)  # one parameter at a time
        spike = step == 3 and rank == 1  # this rank's own loss against its own running average
        if not spike:
            flat = torch.zeros(chunk * world)
            flat[:n] = torch.cat([p.detach().reshape(-1) - 0.01 * p.grad.reshape(-1) for p in params])
            full = torch.empty(chunk * world)
            dist.all_gather_into_tensor(full, flat[rank * chunk : (rank + 1) * chunk].clone())
            off = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(full[off : off + p.numel()].view_as(p))
                    off += p.numel()
        for p in params:
            p.grad = None
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
