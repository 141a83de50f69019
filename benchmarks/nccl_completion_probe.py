"""Probe: does the Work a c10d op hands the dispatcher report completion from another thread, on
this backend? (The recorder's progress thread relies on it.) Run under torchrun.

Answer on NCCL (torch 2.11): for ``async_op=True`` yes (``Work.unbox`` gives the Work, and
``is_completed()`` is True once done); without ``async_op`` the Work is null (``Work.unbox`` gives
None): ``ProcessGroupNCCL`` returns none for sync collectives since torch 2.8. Those are proven
complete from Flight Recorder instead (``moedoctor/recorder/fr_poller.py``)."""

import os
import threading
import time

import torch
import torch.distributed as dist

backend = "nccl" if torch.cuda.is_available() else "gloo"
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)
device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
captured = []
handle = torch.ops.c10d.allreduce_.default._handle
after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
lib = torch.library.Library("c10d", "IMPL")


def kernel(keyset, *args, **kwargs):
    out = handle.redispatch_boxed(keyset & after, *args, **kwargs)
    captured.append(out[-1])
    return out


lib.impl("allreduce_", kernel, "BackendSelect", with_keyset=True)
dist.all_reduce(torch.ones(4, device=device))                      # sync
dist.all_reduce(torch.ones(4, device=device), async_op=True).wait()  # async
torch.cuda.synchronize() if backend == "nccl" else None
time.sleep(0.2)
result = {}


def probe(work):
    result.clear()
    result["type"] = type(work).__name__
    try:
        result["methods"] = work._method_names()
    except Exception as e:
        result["methods"] = repr(e)[:100]
    for name in ("is_completed", "isCompleted"):
        try:
            result[f"script.{name}"] = getattr(work, name)()
        except Exception as e:
            result[f"script.{name}"] = repr(e)[:120]
    try:
        unboxed = torch._C._distributed_c10d.Work.unbox(work)
        result["unboxed"] = type(unboxed).__name__
        result["is_completed"] = unboxed.is_completed()
    except Exception as e:
        result["error"] = repr(e)[:300]


for name, work in zip(("sync", "async"), captured):
    thread = threading.Thread(target=probe, args=(work,))
    thread.start()
    thread.join()
    print(f"[rank {dist.get_rank()}] {backend} probe, {name} all_reduce: {result}", flush=True)
dist.destroy_process_group()
