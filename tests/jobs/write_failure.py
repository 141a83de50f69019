"""The recorder when its own writes fail, in one process on PyTorch's in-process ``fake`` backend
(rank 0 of 2): files are limited to ``--limit`` bytes (``RLIMIT_FSIZE``, SIGXFSZ ignored), so the
trace's writes fail part-way with EFBIG, as they would with ENOSPC on a full disk. The job goes on
with ``--steps`` more collectives and evidence, then prints one JSON line: what the recorder said,
whether its progress thread is alive, and any exception a thread raised.

  python tests/jobs/write_failure.py RUN_DIR [--kernels python|native] [--limit BYTES] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--kernels", choices=["python", "native"], default="python")
    parser.add_argument("--limit", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    os.environ["MOEDOCTOR_NATIVE"] = "1" if args.kernels == "native" else "0"
    thread_errors: list[str] = []
    threading.excepthook = lambda a: thread_errors.append(f"{a.thread.name}: {a.exc_value!r}")
    from moedoctor.recorder import install

    recorder = install(args.run_dir)  # kernels registered (and the native one built) before the limit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.limit, resource.RLIM_INFINITY))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    total = torch.zeros(1)
    for step in range(args.steps):
        x = torch.ones(1)
        dist.all_reduce(x)
        total += x
        recorder.write_evidence("loss", {"index": step, "value": 1.0})
        if step % 10 == 9:  # a real step's other work: the native writer thread gets its turn (it
            time.sleep(0.005)  # wakes every 2 ms), so the cap is hit while the job still runs
    time.sleep(0.5)  # the progress thread polls every 50 ms
    progress = recorder._progress.thread
    print(json.dumps({
        "native": recorder._native is not None and recorder._native.registered,
        "stopped": recorder.stopped, "steps": args.steps, "total": total.item(),
        "progress_thread_died": progress is not None and not progress.is_alive() and recorder.stopped is None,
        "thread_errors": thread_errors,
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
