"""A captioning model whose image encoder is its own FSDP2 unit, kept unsharded for the step
(``reshard_after_forward=False``, resharded after the last micro-batch's backward). The encoder
runs only for micro-batches that carry images, so it is all-gathered by the first such micro-batch.
The loop all-reduces each micro-batch's token count right after its backward. In step 1, rank 1's
first micro-batch has no image: its encoder all-gather comes one micro-batch later than rank 0's,
and rank 0's all-gather meets rank 1's token-count all-reduce."""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DIM, VOCAB, MICRO = 8, 16, 2


class Captioner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, image=None):
        h = self.embed(tokens)
        if image is not None:
            h = h + self.encoder(image).unsqueeze(1)
        return self.head(h)


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    tokens = torch.randint(0, VOCAB, (3, 5), generator=g)
    with_image = not (step == 1 and rank == 1 and micro == 0)
    return tokens, (torch.randn(3, 12, generator=g) if with_image else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Captioner()
    fully_shard(model.encoder, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        seen = 0.0
        for micro in range(MICRO):
            last = micro == MICRO - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            tokens, image = batch(step, rank, micro)
            loss = F.cross_entropy(model(tokens[:, :-1], image).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            (loss / MICRO).backward()
            count = torch.tensor([float(tokens.numel())])
            dist.all_reduce(count)
            seen += count.item()
        opt.step()
        opt.zero_grad()
        print(f"[rank {rank}] step {step} loss {loss.item():.5f} tokens {seen:.0f}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
