"""The recorder's memory and trace size on a long run: a million collectives in one rank.

Runs in one process on PyTorch's in-process ``fake`` backend (rank 0 of 2), so nothing but the
recorder grows: ``--count`` all-reduces of 8 floats (default 1,000,000), with the recorder's kernels
(``--kernels native``, the default where the extension builds, or ``python``). Every ``--every``
collectives it prints the process's resident memory (VmRSS) and the trace file's size, and at the end
the growth per 1,000 collectives of both, and the peak (VmHWM).

  python benchmarks/recorder_memory.py [--count 1000000] [--kernels native|python]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=100_000)
    parser.add_argument("--kernels", choices=["native", "python"], default="native")
    args = parser.parse_args()
    if args.kernels == "native":
        os.environ["MOEDOCTOR_NATIVE"] = "1"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from moedoctor.recorder import install

    recorder = install(Path(tempfile.mkdtemp(prefix="moedoctor-memory-")))
    recorder._progress.completed = lambda work: True  # fake works never say so; real ones do
    if recorder._native is not None:
        recorder._native.assume_completed()
    kind = "native" if recorder._native is not None else "python"
    trace = recorder.run_dir / "traces" / "rank-00000.jsonl"
    tensor = torch.ones(8)
    for _ in range(1000):  # warm-up: interning, allocator pools
        dist.all_reduce(tensor)
    time.sleep(0.2)
    rss0, size0 = status_kib("VmRSS"), trace.stat().st_size
    start = time.perf_counter()
    print(f"{kind} kernels, {args.count} collectives; start: RSS {rss0 / 1024:.1f} MiB, trace {size0 / 1024:.0f} KiB",
          flush=True)
    for i in range(1, args.count + 1):
        dist.all_reduce(tensor)
        if i % args.every == 0:
            time.sleep(0.1)  # let the progress thread catch up with completions
            rss, size = status_kib("VmRSS"), trace.stat().st_size
            print(f"{i:>9} collectives: RSS {rss / 1024:7.1f} MiB (+{(rss - rss0) / 1024:6.1f}), trace "
                  f"{size / 2**20:8.1f} MiB, {time.perf_counter() - start:6.1f} s", flush=True)
    time.sleep(0.1)
    rss, size, peak = status_kib("VmRSS"), trace.stat().st_size, status_kib("VmHWM")
    recorder.close("benchmark")
    per_k = 1000 / args.count
    print(f"recorder-memory: {kind} kernels, {args.count} collectives: RSS +{(rss - rss0) * per_k:.2f} KiB and trace "
          f"+{(size - size0) / 1024 * per_k:.1f} KiB per 1,000 collectives; peak RSS {peak / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
