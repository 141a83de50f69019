"""Step-time cost of moedoctor's recorder on a small FSDP2 training loop.

Run the same command twice, plain and under the recorder, and compare the printed median step times:
  torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_step_overhead.py --backend nccl
  MOEDOCTOR_RUN_DIR=/tmp/r PYTHONPATH=moedoctor/_bootstrap:. torchrun ... (same)
(``benchmarks/step_overhead.sh`` does both with ``moedoctor run``, launches interleaved;
``benchmarks/recorder_toggle.sh`` toggles the recorder inside one process, ``--toggle``).
Prints the median step time, collectives per step and,
when recorded, the trace size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _timing import kernel_split, paired_text


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--toggle", type=int, default=0, metavar="N",
                        help="in one process, alternate blocks of N steps with the whole recorder on and "
                        "paused (kernels off the dispatcher, evidence hooks passing through), and print both "
                        "medians (no run-to-run noise)")
    parser.add_argument("--toggle-part", default="all", choices=["all", "kernels", "hooks"],
                        help="what --toggle switches: the whole recorder, only its dispatcher kernels, or only "
                        "its evidence hooks (to find where the time goes)")
    parser.add_argument("--kernel-clock", action="store_true",
                        help="with --toggle: the native kernel times itself by part and the split is printed "
                        "(the clock's own reads add to the cost measured)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="CUDA: torch.cuda.set_sync_debug_mode('error') around each measured step's "
                        "work (not the timing's own synchronize): any host-device sync in it raises")
    parser.add_argument("--check-params", type=int, default=0, metavar="N",
                        help="install moedoctor run --check-params's hooks (fingerprints at the first forward "
                        "and after optimizer step N) before the model is built, and print the time they took "
                        "and the steps that held them against the median step")
    parser.add_argument("--ddp", type=float, default=0, metavar="MB",
                        help="wrap the model in DDP with buckets of MB megabytes instead of FSDP2 (FSDP2 on a world "
                        "of one rank issues no collectives; DDP still all-reduces its buckets, so one GPU "
                        "measures real steps with the collectives of a smaller bucket size)")
    args = parser.parse_args()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, sync = torch.device("cuda"), torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    dist.init_process_group(args.backend)
    torch.manual_seed(0)
    check = None
    if args.check_params:
        import tempfile
        from pathlib import Path

        from moedoctor.recorder import params as check_params

        check = check_params.installed() or check_params.install(
            Path(tempfile.mkdtemp(prefix="moedoctor-params-")), args.check_params)
    all_times: list[float] = []
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = torch.nn.Sequential(*[Block(args.dim) for _ in range(args.layers)]).to(device)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.ddp)
    else:
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if args.backend == "nccl" else MixedPrecisionPolicy())
        for block in model:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.tokens, args.dim, device=device)
    recorder = None
    if args.toggle:
        import tempfile
        from pathlib import Path

        from moedoctor.recorder.install import install, installed_recorder

        # Under `moedoctor run` the recorder was installed at start-up, as users run it (native
        # kernels, hooks in place before the model was built); else one is installed here.
        recorder = installed_recorder() or install(Path(tempfile.mkdtemp(prefix="moedoctor-step-")))
        if args.kernel_clock and getattr(recorder, "_native", None) is not None:
            recorder._native.set_clock(True)
    times, toggled = [], {True: [], False: []}
    # The training thread's CPU time per step, taken before the closing synchronize (which may spin):
    # on a host-bound loop it is what the recorder adds to that thread, without the launch noise.
    cpu_times, cpu_toggled = [], {True: [], False: []}
    blocks: dict[bool, list[float]] = {True: [], False: []}  # each block's median step, in order
    for step in range(args.warmup + args.steps):
        recording = bool(args.toggle) and (step // args.toggle) % 2 == 0
        if recorder is not None and step % args.toggle == 0:
            if args.toggle_part == "all":
                recorder.resume() if recording else recorder.pause()
            elif args.toggle_part == "kernels":
                recorder.register_kernels() if recording else recorder.unregister_kernels()
            else:
                recorder.paused = not recording
        sync()
        start, cpu_start = time.perf_counter(), time.thread_time()
        checked = args.sync_debug and args.backend == "nccl" and step >= args.warmup
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        loss = model(x).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if checked:
            torch.cuda.set_sync_debug_mode("default")
        cpu = time.thread_time() - cpu_start
        sync()
        all_times.append(time.perf_counter() - start)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            toggled[recording].append(times[-1])
            cpu_times.append(cpu)
            cpu_toggled[recording].append(cpu)
            if args.toggle and (step + 1) % args.toggle == 0 and step + 1 - args.toggle >= args.warmup:
                blocks[recording].append(statistics.median(times[-args.toggle:]))
    if dist.get_rank() == 0:
        if args.sync_debug and args.backend == "nccl":
            print(f"sync debug: {args.steps} steps ran under set_sync_debug_mode('error'), no host-device sync")
        seq = dist.group.WORLD._get_sequence_number_for_group()
        recorded = "recorded" if os.environ.get("MOEDOCTOR_RUN_DIR") else "plain"
        if args.toggle:
            on, off = statistics.median(toggled[True]), statistics.median(toggled[False])
            native = getattr(recorder, "_native", None)
            split = kernel_split(native) if native is not None else None
            if split:
                print(split)
            progress = recorder._progress
            print(f"progress thread: {progress.wakes} wake-ups, {progress.busy_s * 1e3:.1f} ms busy in all "
                  f"({progress.busy_s / max(sum(times), 1e-9) * 100:.2f}% of the timed steps' time)")
            print(f"toggled in-process every {args.toggle} steps ({args.toggle_part}): "
                  f"recorder off {off * 1e3:.3f} ms, "
                  f"on {on * 1e3:.3f} ms, added {(on - off) / off * 100:+.2f}% "
                  f"({len(toggled[True])} + {len(toggled[False])} steps); blocks of {args.toggle} "
                  f"{paired_text(blocks[True], blocks[False])}")
            con, coff = statistics.median(cpu_toggled[True]), statistics.median(cpu_toggled[False])
            print(f"training thread CPU per step: off {coff * 1e3:.3f} ms, on {con * 1e3:.3f} ms, "
                  f"added {(con - coff) / coff * 100:+.2f}%")
        if check is not None:
            spent = {name: round(seconds * 1e3, 3) for name, seconds in check.spent.items()}
            held = {0: all_times[0], args.check_params - 1: all_times[args.check_params - 1]}
            print(f"check-params: ms in its hooks {spent}; steps holding a checkpoint "
                  + ", ".join(f"{s}: {t * 1e3:.3f} ms" for s, t in held.items())
                  + f"; median of the timed steps {statistics.median(times) * 1e3:.3f} ms")
        print(f"{recorded}: backend={args.backend} world={dist.get_world_size()} dim={args.dim} "
              f"layers={args.layers} tokens={args.tokens} median step {statistics.median(times) * 1e3:.3f} ms "
              f"(min {min(times) * 1e3:.3f}) collectives/step {seq / (args.warmup + args.steps):.1f} "
              f"thread CPU {statistics.median(cpu_times) * 1e3:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
