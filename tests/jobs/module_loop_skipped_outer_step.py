"""A training loop written at the script's top level (no function around it), one backward pass a step.
Each step begins with a broadcast of the step's task; after backward a wrapper's step() all-reduces
the gradients and then runs the torch optimizer, unless the rank's own loss is not finite (`ok =
bool(torch.isfinite(loss))`, then `if not ok: continue`). At step 3 rank 1's loss is NaN: it issues
the next step's broadcast while rank 0 all-reduces. The decision is read at the top level too, and no
step ever had two backward passes, so this is a skipped optimizer step, not another micro-batch
(corpus 30's MAML outer step was named `microbatch-count-mismatch`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist


class AveragedSGD:
    def __init__(self, params):
        self.params = list(params)
        self.opt = torch.optim.SGD(self.params, lr=0.01)

    def step(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat)
        off = 0
        for p in self.params:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        self.opt.step()


dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
opt = AveragedSGD(model.parameters())
for step in range(6):
    seed = torch.tensor([step])
    dist.broadcast(seed, src=0)  # the step's task, from rank 0's sampler
    loss = model(torch.randn(4, 8)).pow(2).mean()
    if step == 3 and rank == 1:
        loss = loss * float("nan")  # an empty class in this rank's episode
    opt.opt.zero_grad()
    loss.backward()
    ok = bool(torch.isfinite(loss))
    if not ok:
        continue
    opt.step()
print(f"[rank {rank}] done", flush=True)
dist.destroy_process_group()
