"""A loop that skips the step inline on a rank-local non-finite loss (no function to patch: the
decision is ``if bad: continue`` in the loop), then a ZeRO-like parameter broadcast that only the
stepping rank issues. ``moedoctor run`` names the ``if``; ``moedoctor verify`` makes it collective."""

import argparse
import datetime
import math
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        if step == 2 and rank == 1:
            x[0, 0] = float("inf")  # the data: one sample overflows on one rank
        scale = x.abs().mean(0, keepdim=True).nan_to_num(1.0, 1.0, 1.0)
        dist.all_reduce(scale)  # batch statistics shared across ranks, as a forward pass would
        loss = model(x / scale).pow(2).mean()
        loss.backward()
        bad = not math.isfinite(loss.item())
        if bad:
            optimizer.zero_grad(set_to_none=True)
            continue
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        print(f"[rank {rank}] step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
