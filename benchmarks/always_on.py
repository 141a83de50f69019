"""Always-on cost of the WHOLE recorder, measured in one process (issue 31).

One FSDP2 training loop (2 ranks by default: Gloo on CPU, NCCL with ``--backend nccl``) alternates
blocks of steps with the whole recorder on and paused (``Recorder.pause()``: the dispatcher kernels
off the dispatcher, every evidence hook passing through, the progress thread, which writes the
Work completions, deferred evidence and the Flight Recorder polls, idle). Blocks come in pairs whose
order alternates (on-off, off-on, ...), so drift slower than a pair cancels; each pair gives one
relative difference, for the step time and for the training thread's CPU time (``time.thread_time()``
of the thread that runs forward and backward and issues the collectives, summed over the ranks: each
rank's is a measurement), of the two blocks' least figures (other jobs on the host only ever add
time). The estimate is the median of the pairs' differences with a bootstrap 95% interval. The first
step of every block is run, not timed (``--settle``): it absorbs the toggle itself.

What pausing cannot take away: the evidence hooks stay installed (torch cannot remove global hooks;
paused, each is one more Python call that checks a flag, five a step, below what a timing of each
wrapper against the function it wraps resolves on a loaded 2-core VM), and the native kernel's flush
thread keeps waking every 2 ms (it writes only when records are buffered).

  python benchmarks/always_on.py                       # 2 Gloo ranks on CPU, 145 collectives/step
  python benchmarks/always_on.py --backend nccl        # 2 GPUs (same loop, bf16 params)
  python benchmarks/always_on.py --versus immediate    # recorder on throughout: the native kernel's formatting
                                                       # deferred to its writer thread (on) or done at once (off)
  python benchmarks/always_on.py --versus progress     # recorder on throughout: its progress thread working (on)
                                                       # or idle (off)
  python benchmarks/always_on.py --versus gil          # recorder on throughout: call-site cache hits recorded
                                                       # without the GIL (on) or with it (off)
  python benchmarks/always_on.py --versus kernels      # recorder on throughout: dispatcher kernels on or off
  python benchmarks/always_on.py --versus hooks        # recorder on throughout: evidence hooks on or passing through
  python benchmarks/always_on.py --versus futures      # recorder on throughout: Gloo Works report completion
                                                       # through their future, not held (on), or held and polled
  python benchmarks/always_on.py --versus flush        # recorder on throughout: the kernel's writer every 2 ms (on)
                                                       # or every --flush-ms (off)
  moedoctor run -- torchrun --nproc_per_node 2 benchmarks/always_on.py   # the recorder as installed by `moedoctor run`

Without torchrun's environment the script starts itself under ``torch.distributed.run``. The last
line is ``always-on: N collectives/step, training-thread CPU +X% (CI lo..hi), step time +Y% (CI lo..hi)``.
Before it, the recording threads' CPU: the training thread's with that of the threads that run
backward (on GPUs, autograd's device threads, where FSDP2's backward collectives are recorded; on CPU
the training thread itself), and the process CPU (every thread of the rank: the recorder's writer and
progress threads, the backend's), paired the same way; ``--pool`` pools them too where the dumps have
them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import kernel_split, paired  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--nproc", type=int, default=2, help="ranks, when the script starts torchrun itself")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=48, help="FSDP2 units: 3 collectives each per step, +1")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=60, help="pairs of blocks (one on, one paused)")
    parser.add_argument("--block", type=int, default=2, help="timed steps per block")
    parser.add_argument("--settle", type=int, default=1, help="untimed steps at the start of every block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the first block (recording)")
    parser.add_argument(
        "--recorder",
        default="native",
        choices=["native", "python"],
        help="the kernels, when the script installs the recorder (under `moedoctor run` the one it installed is used)",
    )
    parser.add_argument(
        "--sync-debug", action="store_true", help="CUDA: every timed step under torch.cuda.set_sync_debug_mode('error')"
    )
    parser.add_argument(
        "--kernel-clock",
        action="store_true",
        help="the native kernel times itself by part, printed (its clock's reads add to the cost)",
    )
    parser.add_argument(
        "--versus",
        default="paused",
        choices=["paused", "immediate", "progress", "gil", "flush", "kernels", "hooks", "futures"],
        help="what the on blocks are compared with: the recorder paused (the always-on A/B), or the recorder on "
        "with the native kernel formatting each record on the training thread (MOEDOCTOR_DEFER_FORMAT=0's path; "
        "the on blocks defer it to the writer thread, the default), or the recorder on with its progress thread "
        "idle (its Work polls, deferred evidence and Flight Recorder polls: their share of the step time), or the "
        "recorder on with the native kernel taking the GIL for every collective (MOEDOCTOR_GIL_FREE=0's path; the on "
        "blocks record call-site cache hits without it, the default), or the recorder on with the native kernel's "
        "writer thread waking every --flush-ms instead of its default period (the on blocks: the default), or the "
        "recorder on with its dispatcher kernels off the dispatcher (kernels) or its evidence hooks passing through "
        "(hooks) in the off blocks: each part's share, or the recorder on with every Work held and polled by the "
        "progress thread in the off blocks (futures; the on blocks: a Work with a CPU future reports through it)",
    )
    parser.add_argument(
        "--flush-ms",
        type=float,
        default=20.0,
        help="--versus flush: the writer thread's period in the off blocks, in milliseconds",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        metavar="S",
        help="the recorder's progress thread wakes every S seconds instead of its default (0.2): how much of the "
        "on blocks' step time its wake-ups (holding the GIL) account for",
    )
    parser.add_argument("--dump", metavar="FILE", help="rank 0: every block's figures as JSON, for analysis")
    parser.add_argument(
        "--pool",
        nargs="+",
        metavar="FILE",
        help="no run: pool the pairs of earlier --dump files and print the always-on line for all of them",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="rank 0: cProfile of the training thread over the recording blocks, written to FILE",
    )
    return parser.parse_args(argv)


def relaunch(args: argparse.Namespace) -> int:
    """Not under torchrun: run this script under ``torch.distributed.run`` with the same arguments."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        __file__,
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


def pool(files: list[str]) -> int:
    """The always-on line over the pairs of several runs' ``--dump`` files (runs of one loop)."""
    import json

    from _timing import paired

    runs = [json.loads(Path(f).read_text()) for f in files]
    every = lambda key: [x for run in runs for x in run[key]]  # noqa: E731
    cpu, step = paired(every("cpu_on"), every("cpu_off")), paired(every("step_on"), every("step_off"))
    print(f"pooled: {len(runs)} runs, {cpu[3]} pairs")
    extra = {"cpu_all": "recording threads' CPU (training + backward)", "cpu_proc": "process CPU (every thread)"}
    for key, what in extra.items():
        having = [run for run in runs if f"{key}_on" in run]  # dumps from before the field lack it
        if having:
            mid, lo, hi, n = paired(*([x for run in having for x in run[f"{key}_{side}"]] for side in ("on", "off")))
            print(f"{what}, {n} pairs: {mid:+.2f}% (CI {lo:+.2f}..{hi:+.2f})")
    print(always_on_line(runs[0]["collectives_per_step"], cpu, step))
    return 0


def always_on_line(per_step: float, cpu: tuple, step: tuple) -> str:
    """The script's last line, from ``paired``'s (median, low, high, pairs) of the training thread's
    CPU time and of the step time."""
    return (
        f"always-on: {per_step:.0f} collectives/step, training-thread CPU {cpu[0]:+.2f}% "
        f"(CI {cpu[1]:+.2f}..{cpu[2]:+.2f}), step time {step[0]:+.2f}% (CI {step[1]:+.2f}..{step[2]:+.2f})"
    )


def main() -> int:
    args = parse()
    if args.pool:
        return pool(args.pool)
    if "LOCAL_RANK" not in os.environ:
        return relaunch(args)
    if args.recorder == "native":
        os.environ.setdefault("MOEDOCTOR_NATIVE", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_step_overhead import Block  # the loop of the earlier step benchmarks
    from moedoctor.recorder.install import install, installed_recorder

    torch.set_num_threads(1)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, sync = torch.device("cuda"), torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    # Installed before the model is built, as `moedoctor run`'s bootstrap does at torch's import.
    recorder = installed_recorder() or install(Path(tempfile.mkdtemp(prefix="moedoctor-always-on-")))
    kernels = "native" if recorder._native is not None else "python"
    if args.versus in ("immediate", "gil", "flush", "futures") and recorder._native is None:
        raise SystemExit(f"--versus {args.versus} needs the native kernel")
    if args.poll_interval is not None:
        recorder._progress.poll_interval = args.poll_interval
    if args.kernel_clock and recorder._native is not None:
        recorder._native.set_clock(True)
    default_flush_ms = recorder._native.flush_every() if recorder._native is not None else None
    torch.manual_seed(0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    model = torch.nn.Sequential(*[Block(args.dim) for _ in range(args.layers)]).to(device)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.backend == "nccl"
        else MixedPrecisionPolicy()
    )
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.tokens, args.dim, device=device)

    # The threads that run backward (on GPUs, autograd's device threads; on CPU, this one): their CPU
    # time with the training thread's is the recording threads' CPU per step (FSDP2's backward
    # collectives are recorded on the autograd thread, not the training thread).
    main_ident = threading.get_ident()
    backward_threads: set[int] = set()

    def note_backward_thread(grad):
        backward_threads.add(threading.get_ident())
        return grad

    def backward_cpu() -> float:  # the backward threads' other than this one
        total = 0.0
        for ident in backward_threads - {main_ident}:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:  # the thread ended
                pass
        return total

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.register_hook(note_backward_thread)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def sequence() -> int:
        from torch.distributed.distributed_c10d import _world

        return sum(int(pg._get_sequence_number_for_group()) for pg in list(_world.pg_names))

    profiler = None
    if args.profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    for _ in range(args.warmup):
        step()
    sync()
    # blocks[on] = [(shortest step s, least thread CPU s), ...] in pair order: other jobs on the host
    # only ever add time to a step, so a block's least is its figure least disturbed by them.
    blocks: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    steps: dict[bool, list[list[tuple[float, float]]]] = {True: [], False: []}  # every timed step, for --dump
    recorded = {True: 0, False: 0}  # collectives recorded during the on / paused blocks
    collectives = {True: 0, False: 0}  # collectives issued (the backends' counters) in timed steps
    timed_steps = {True: 0, False: 0}
    for pair in range(args.pairs):
        for on in (True, False) if pair % 2 == 0 else (False, True):
            if args.versus == "immediate":  # the recorder on in both; formatting deferred in the on blocks
                recorder._native.set_defer(on)
            elif args.versus == "progress":  # the recorder on in both; its progress thread idle in the off blocks
                recorder._progress.idle = not on
            elif args.versus == "gil":  # the recorder on in both; the GIL taken for every collective in the off blocks
                recorder._native.set_gil_free(on)
            elif args.versus == "kernels":  # the hooks and the progress thread on in both
                recorder.register_kernels() if on else recorder.unregister_kernels()
            elif args.versus == "hooks":  # the kernels and the progress thread on in both
                recorder.paused = not on
            elif args.versus == "futures":  # the recorder on in both; every Work held and polled in the off blocks
                recorder._native.set_work_futures(on)
            elif args.versus == "flush":  # the recorder on in both; the writer wakes less often in the off blocks
                recorder._native.set_flush_every(default_flush_ms if on else args.flush_ms)
            else:
                recorder.resume() if on else recorder.pause()
            for _ in range(args.settle):
                step()
            sync()
            events, issued = recorder._events_recorded(), sequence()
            wall, cpu, cpu_all, cpu_proc = [], [], [], []
            for _ in range(args.block):
                checked = args.sync_debug and args.backend == "nccl"
                if checked:
                    torch.cuda.set_sync_debug_mode("error")
                if profiler is not None and on:
                    profiler.enable()
                start, cpu_start, backward_start = time.perf_counter(), time.thread_time(), backward_cpu()
                proc_start = time.process_time()
                step()
                spent = time.thread_time() - cpu_start  # before the closing synchronize, which may spin
                spent_all = spent + backward_cpu() - backward_start
                spent_proc = time.process_time() - proc_start  # every thread of the rank: the recorder's own too
                if profiler is not None and on:
                    profiler.disable()
                if checked:
                    torch.cuda.set_sync_debug_mode("default")
                sync()
                wall.append(time.perf_counter() - start)
                cpu.append(spent)
                cpu_all.append(spent_all)
                cpu_proc.append(spent_proc)
            blocks[on].append((min(wall), min(cpu), min(cpu_all), min(cpu_proc)))
            steps[on].append(list(zip(wall, cpu, cpu_all, cpu_proc)))
            recorded[on] += recorder._events_recorded() - events
            collectives[on] += sequence() - issued
            timed_steps[on] += args.block
    recorder.pause()  # the report's own collectives below are not the loop's
    # Every rank's CPU figures (training thread, recording threads, process), summed over the ranks
    # block by block: each rank's is a measurement.
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {on: [b[1:] for b in blocks[on]] for on in (True, False)})

    def summed(column: int) -> tuple[list[float], list[float]]:  # (on blocks, off blocks)
        on_off = ([sum(r[on][i][column] for r in gathered) for i in range(len(blocks[on]))] for on in (True, False))
        return tuple(on_off)  # type: ignore[return-value]

    every = [{on: [b[0] for b in r[on]] for on in (True, False)} for r in gathered]  # the training thread's, by rank
    progress = recorder._progress
    if profiler is not None:
        profiler.dump_stats(args.profile)
    if rank == 0:
        per_step = collectives[True] / max(timed_steps[True], 1)
        wall_on, wall_off = [b[0] for b in blocks[True]], [b[0] for b in blocks[False]]
        cpu_on, cpu_off = summed(0)
        step_mid, step_lo, step_hi, pairs = paired(wall_on, wall_off)
        cpu_mid, cpu_lo, cpu_hi, _ = paired(cpu_on, cpu_off)
        all_on, all_off = summed(1)
        all_mid, all_lo, all_hi, _ = paired(all_on, all_off)
        proc_on, proc_off = summed(2)
        proc_mid, proc_lo, proc_hi, _ = paired(proc_on, proc_off)
        print(
            f"loop: backend={args.backend} world={dist.get_world_size()} dim={args.dim} layers={args.layers} "
            f"tokens={args.tokens} {kernels} kernels; {pairs} pairs of blocks of {args.block} timed steps "
            f"(+{args.settle} settling), order alternating"
        )
        print(
            f"recorded: {recorded[True]} collectives in the on blocks' steps (issued {collectives[True]}), "
            f"{recorded[False]} in the paused ones (issued {collectives[False]})"
        )
        print(
            f"step time: off {statistics.median(wall_off) * 1e3:.3f} ms, on {statistics.median(wall_on) * 1e3:.3f} ms "
            f"(medians of the blocks' shortest)"
        )
        world = dist.get_world_size()
        print(
            f"training thread CPU per step and rank: off {statistics.median(cpu_off) / world * 1e3:.3f} ms, "
            f"on {statistics.median(cpu_on) / world * 1e3:.3f} ms (the ranks' sum per block, paired)"
        )
        print(
            f"recording threads' CPU per step and rank (training + {len(backward_threads - {main_ident})} "
            f"backward thread(s)): off {statistics.median(all_off) / world * 1e3:.3f} ms, on "
            f"{statistics.median(all_on) / world * 1e3:.3f} ms; "
            f"paired {all_mid:+.2f}% (CI {all_lo:+.2f}..{all_hi:+.2f})"
        )
        print(
            f"process CPU per step and rank (every thread: the recorder's writer and progress threads too): off "
            f"{statistics.median(proc_off) / world * 1e3:.3f} ms, "
            f"on {statistics.median(proc_on) / world * 1e3:.3f} ms; "
            f"paired {proc_mid:+.2f}% (CI {proc_lo:+.2f}..{proc_hi:+.2f})"
        )
        poller = progress._fr_poller
        polls = (
            f"; Flight Recorder: {poller.polls} polls, {poller.total_cost * 1e3:.1f} ms"
            if poller
            else "; Flight Recorder polls off"
        )
        print(
            f"progress thread: {progress.wakes} wake-ups, {progress.busy_s * 1e3:.1f} ms busy in all "
            f"({progress.busy_cpu_s * 1e3:.1f} ms of its own CPU){polls}"
        )
        split = kernel_split(recorder._native) if recorder._native is not None else None
        if split:
            print(split)
        if args.dump:
            import json

            Path(args.dump).write_text(
                json.dumps(
                    {
                        "args": vars(args),
                        "kernels": kernels,
                        "collectives_per_step": per_step,
                        "step_on": wall_on,
                        "step_off": wall_off,
                        "cpu_on": cpu_on,
                        "cpu_off": cpu_off,
                        "cpu_by_rank": every,
                        "cpu_all_on": all_on,
                        "cpu_all_off": all_off,
                        "cpu_proc_on": proc_on,
                        "cpu_proc_off": proc_off,
                        "rank0_steps": steps,
                    }
                )
            )
        if args.versus != "paused":  # on = deferred / progress thread working, off = immediate / idle
            what = {
                "immediate": "deferred formatting vs immediate",
                "progress": "progress thread vs idle",
                "gil": "GIL-free cache hits vs the GIL taken",
                "kernels": "dispatcher kernels vs none",
                "hooks": "evidence hooks vs passing through",
                "futures": "Works' completion from their futures vs Works held and polled",
                "flush": f"writer every {default_flush_ms:g} ms vs every {args.flush_ms:g} ms",
            }[args.versus]
            print(
                f"{what}: {per_step:.0f} collectives/step, training-thread CPU "
                f"{cpu_mid:+.2f}% (CI {cpu_lo:+.2f}..{cpu_hi:+.2f}), step time {step_mid:+.2f}% "
                f"(CI {step_lo:+.2f}..{step_hi:+.2f})",
                flush=True,
            )
        else:
            print(always_on_line(per_step, (cpu_mid, cpu_lo, cpu_hi), (step_mid, step_lo, step_hi)), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
