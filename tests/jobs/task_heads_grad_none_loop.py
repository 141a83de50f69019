"""A multi-task model with one head per task (a module list), gradients all-reduced one parameter at
a time, skipping parameters whose gradient is None, then a per-task count all-reduced for the log.
At step 2 rank 1's batch holds no sample of task 1, so that head gets no gradient there: rank 1's
loop issues fewer all-reduces and goes on to the count while rank 0 still reduces the head's
gradients. The trace shows a loop left early by rank 1 and the recorder's parameters without a
gradient name members of the heads list on rank 1 only: inactive experts (task-routed heads).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

TASKS = 3


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(TASKS))

    def forward(self, x: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        loss = h.sum() * 0
        for t, head in enumerate(self.heads):
            sel = task == t
            if sel.any():
                loss = loss + head(h[sel]).pow(2).mean()
        return loss


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        task = torch.arange(6) % TASKS
        if step == 2 and rank == 1:
            task = torch.tensor([0, 2, 0, 2, 0, 2])  # no sample of task 1 in this batch
        model(torch.randn(6, 8), task).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        per_task = torch.bincount(task, minlength=TASKS).float()
        dist.all_reduce(per_task)  # samples per task this step, for the log
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
