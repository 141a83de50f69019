"""A sparse MoE layer written inline (no class moedoctor knows), each expert its own FSDP2 unit on a
cpu mesh. At step 1 rank 1's tokens route to experts 0 and 1 only, so its loop never calls experts 2
and 3: their all-gathers and reduce-scatters are missing on rank 1 and the job desyncs."""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DIM, EXPERTS, VOCAB = 8, 4, 16


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Embedding(VOCAB, EXPERTS)
        with torch.no_grad():  # token t goes to expert t % EXPERTS
            self.gate.weight.copy_(torch.eye(EXPERTS)[torch.arange(VOCAB) % EXPERTS] * 4)
        self.ffn = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 16), nn.SiLU(), nn.Linear(16, DIM))
                                 for _ in range(EXPERTS))

    def forward(self, h, tokens):
        choice = self.gate(tokens).argmax(-1)
        out = h.clone()
        for e in range(EXPERTS):
            picked = (choice == e).nonzero(as_tuple=True)
            if picked[0].numel() == 0:
                continue
            out[picked] = out[picked] + self.ffn[e](h[picked])
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = Moe()
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.out(self.moe(self.embed(tokens), tokens))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    net = Net()
    for expert in net.moe.ffn:
        fully_shard(expert, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(step * 7 + rank))
        if step == 1 and rank == 1:
            tokens = tokens % 2  # this rank's batch happens to hold only tokens 0 and 1
        loss = F.cross_entropy(net(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"[rank {rank}] step {step} loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
