"""Factory-built runs, one per deadlock pattern (and the controls), for the analysis unit tests.

Each returns the builders of its ranks plus what ``run_of`` needs; ``SCENARIOS`` maps a name to
(build function, expected pattern, expected culprits, expected verdict).
"""

from __future__ import annotations

from event_factory import (
    TraceBuilder, in_collective, manifest, ranks, run_of, stack,
)

from moedoctor.analysis.loading.run_data import GpuSnapshot
from moedoctor.events import Coverage, Group, Phase

F, B, O, S, CK = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER, Phase.CHECKPOINT_SAVE


def _fsdp_step(r: TraceBuilder, step: int, optimizer_collective: bool = True) -> None:
    r.coll("all_gather", (272,), phase=F, step=step, module="0", line=69)
    r.coll("all_gather", (528,), phase=F, step=step, module="2", line=69)
    r.ev("backward_begin", step)
    r.coll("reduce_scatter", (1056,), phase=B, step=step, module="2", line=70, reduce_op="avg")
    r.coll("reduce_scatter", (544,), phase=B, step=step, module="0", line=70, reduce_op="avg")
    r.ev("backward_end", step)
    r.ev("grad_norm", step, norm=0.9, finite=True, site="/job/optim.py:82")
    if optimizer_collective:
        r.ev("optimizer_step_begin", step)
        r.coll("all_reduce", (), phase=O, step=step, line=45, file="/job/optim.py", function="_global_grad_norm",
               reduce_op="sum")
        r.ev("optimizer_step_end", step + 1)


def skipped_optimizer_step():
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            _fsdp_step(r, step)
    for r in (a, b):
        r.coll("all_gather", (272,), phase=F, step=2, module="0", line=69)
        r.coll("all_gather", (528,), phase=F, step=2, module="2", line=69)
        r.ev("backward_begin", 2)
        r.coll("reduce_scatter", (1056,), phase=B, step=2, module="2", line=70, reduce_op="avg")
        r.coll("reduce_scatter", (544,), phase=B, step=2, module="0", line=70, reduce_op="avg")
    a.ev("grad_norm", 2, norm=0.8, finite=True, site="/job/optim.py:82")
    a.ev("optimizer_step_begin", 2)
    a.coll("all_reduce", (), phase=O, step=2, line=45, file="/job/optim.py", reduce_op="sum", done=False)
    b.ev("grad_norm", 2, norm="inf", finite=False, site="/job/optim.py:82")
    b.coll("all_gather", (272,), phase=F, step=2, module="0", line=69, done=False)
    return run_of(a, b, hang=True)


def inflight_metric_allreduce():
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            r.coll("all_gather", (176,), phase=F, step=step, module="layers.0", line=151, file="/job/moe.py")
            r.coll("all_gather", (768,), phase=F, step=step, module="layers.0.mlp.experts.3", line=83,
                   file="/job/moe.py")
            r.coll("all_reduce", (1,), dtype="float64", phase=S, step=step, line=35, function="all_reduce_metrics")
            r.coll("all_reduce", (1,), dtype="float64", phase=S, step=step, line=35, function="all_reduce_metrics")
            r.coll("reduce_scatter", (2064,), phase=B, step=step, module="layers.0", line=49, reduce_op="avg")
    for r in (a, b):
        r.coll("all_gather", (176,), phase=F, step=2, module="layers.0", line=151, file="/job/moe.py")
    # Rank 1 routed no token to expert 3 in this micro-batch: no all-gather of it before the metric.
    a.coll("all_gather", (768,), phase=F, step=2, module="layers.0.mlp.experts.3", line=83, file="/job/moe.py",
           done=False)
    b.coll("all_reduce", (1,), dtype="float64", phase=S, step=2, line=35, function="all_reduce_metrics", done=False)
    return run_of(a, b, hang=True)


def uneven_dtensor_allgather():
    a, b = ranks(2)
    for r in (a, b):
        _fsdp_step(r, 0)
    for r, keys in ((a, 4), (b, 3)):
        for key in range(keys):
            r.coll("all_gather", (1,), dtype="int64", phase=CK, step=1, line=36, file="/job/ckpt.py",
                   function="_update_offsets")
            r.coll("all_gather", (17 + key,), dtype="uint8", phase=CK, step=1, line=36, file="/job/ckpt.py",
                   function="_update_offsets", done=not (r is a and key == 3))
            if r is a and key == 3:
                break
            r.coll("all_reduce", (1, 2), dtype="int64", phase=CK, step=1, line=68, file="/job/ckpt.py")
    b.ev("checkpoint_save_begin", 1, function="save")
    b.coll("all_gather", (1,), dtype="int64", phase=CK, step=1, line=83, file="/job/ckpt.py", function="save_ckpt")
    b.coll("gather", (20,), dtype="uint8", phase=CK, step=1, line=83, file="/job/ckpt.py", function="save_ckpt",
           done=False)
    return run_of(a, b, hang=True)


def inactive_experts():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (3248,), phase=F, step=step, module="layers.1", line=151, file="/job/moe.py")
            size = 4960 if (step == 2 and r is b) else 6496
            r.coll("reduce_scatter", (size,), phase=B, step=step, module="layers.1", line=53, reduce_op="avg",
                   done=step < 2)
            if step == 2:
                continue
            r.coll("reduce_scatter", (2064,), phase=B, step=step, module=None, line=53, reduce_op="avg")
            r.ev("optimizer_step_begin", step)
    b.ev("params_without_grad", 2, names=["layers.1.mlp.experts.3.w1", "layers.1.mlp.experts.3.w2"], count=2)
    return run_of(a, b, manifest_info=manifest({0: -15, 1: -6}, hang=False))


def rank_conditional_collective():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (64,), phase=F, step=step, module="0", line=40)
            if step == 2 and r is a:
                r.coll("all_reduce", (1,), phase=S, step=step, line=80, function="log_progress", done=False)
                continue
            r.coll("all_reduce", (577,), phase=S, step=step, line=50, function="all_reduce_gradients",
                   done=step < 2)
    return run_of(a, b, hang=True)


def microbatch_count_mismatch():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            n = 3 if (step == 2 and r is a) else 2
            for mb in range(n):
                last = step == 2 and r is a and mb == 2
                r.coll("all_gather", (272,), phase=F, step=step, module="0", line=46, done=not last)
                if last:
                    break
                r.ev("backward_begin", step)
                r.coll("reduce_scatter", (544,), phase=B, step=step, module="0", line=47, reduce_op="avg")
                r.ev("backward_end", step)
            if step == 2 and r is a:
                continue
            r.ev("grad_norm", step, norm=1.0, finite=True, site="/job/train.py:60")
            r.ev("optimizer_step_begin", step)
            r.coll("all_reduce", (1,), phase=O, step=step, line=61, reduce_op="sum", done=step < 2)
    return run_of(a, b, hang=True)


TP = Group("1", "tp", (0, 1))
DP = Group("2", "dp", (0, 1))


def collective_order_inversion(host_blocks: bool = True):
    """Two groups over the same ranks; at step 2 rank 1 issues the dp collective first. With
    ``host_blocks`` (Gloo) each rank stops at its first; else (NCCL) both are issued everywhere."""
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            order = [(TP, 30), (DP, 31)]
            if step == 2 and r is b:
                order.reverse()
            for i, (group, line) in enumerate(order):
                if step == 2 and host_blocks and i == 1:
                    break
                r.coll("all_reduce", (8,), group=group, phase=S, step=step, line=line, done=step < 2)
    return run_of(a, b, hang=True)


def shape_mismatch():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            size = 600 if (step == 2 and r is b) else 577
            r.coll("all_reduce", (size,), phase=S, step=step, line=50, done=step < 2)
    return run_of(a, b, hang=True)


def straggler():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            if step == 2 and r is b:
                continue
            r.coll("all_reduce", (577,), phase=S, step=step, line=53, done=step < 2)
    stacks = [in_collective(0, 53), stack(1, ("ShardReader._read_shard", "/job/train.py", 43),
                                          ("__next__", "/job/train.py", 36), ("main", "/job/train.py", 70))]
    return run_of(a, b, hang=True, stacks=stacks)


def not_a_desync(stacks: list | None = None, completions: bool = True):
    """Both ranks inside the same all-reduce, none completing it. By default what ``not-a-desync``
    needs: completions observed (earlier steps completed) and both stacks inside the collective."""
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_reduce", (1313793,), phase=S, step=step, line=42, done=completions and step < 2)
    a.coverage.append(Coverage(0, 2000.0, "snapshot", ()))
    stacks = [in_collective(0, 42), in_collective(1, 42)] if stacks is None else stacks
    gpus = [GpuSnapshot("host", False, "no NVML: NVML Shared Library Not Found")]
    return run_of(a, b, hang=True, stacks=stacks, gpus=gpus)


def rank_stopped(state: str = "T", stack_error: str | None = None, n: int = 4):
    """Rank 1 stopped itself in its own code before step 2's all-reduce (SIGSTOP: state T), or sits
    in the kernel (``D``); the others wait in that all-reduce for it."""
    builders = ranks(n)
    for step in range(3):
        for r in builders:
            if step == 2 and r.rank == 1:
                continue
            r.coll("all_reduce", (577,), phase=S, step=step, line=53, done=step < 2)
    stacks = [in_collective(r.rank, 53, state="S") for r in builders if r.rank != 1]
    if stack_error:
        stacks.append(stack(1, error=stack_error, state=state))
    else:
        stacks.append(stack(1, ("main", "/job/train.py", 48), state=state,
                            wchan="do_signal_stop" if state == "T" else "nfs_wait_bit_killable"))
    return run_of(*builders, hang=True, stacks=stacks)


def unknown_desync():
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            r.coll("all_reduce", (577,), phase=S, step=step, line=50)
    a.coll("all_reduce", (577,), phase=S, step=2, line=50, done=False)
    b.coll("broadcast", (577,), phase=S, step=2, line=50, done=False)
    return run_of(a, b, hang=True)


def healthy():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            _fsdp_step(r, step)
    return run_of(a, b, manifest_info=manifest({0: 0, 1: 0}, hang=False, source="launcher"))


SCENARIOS = {
    "skipped-optimizer-step": (skipped_optimizer_step, [1], "desync"),
    "inflight-metric-allreduce": (inflight_metric_allreduce, [1], "desync"),
    "uneven-dtensor-allgather": (uneven_dtensor_allgather, [1], "desync"),
    "inactive-experts": (inactive_experts, [1], "crashed"),
    "rank-conditional-collective": (rank_conditional_collective, [0], "desync"),
    "microbatch-count-mismatch": (microbatch_count_mismatch, [1], "desync"),  # the rank with fewer micro-batches
    "collective-order-inversion": (collective_order_inversion, [1], "desync"),
    "shape-mismatch": (shape_mismatch, [1], "desync"),
    "straggler": (straggler, [1], "stuck"),
    "not-a-desync": (not_a_desync, [], "stuck"),
    "rank-stopped": (rank_stopped, [1], "stuck"),
    "unknown-desync": (unknown_desync, None, "desync"),
}


def units_skipped(unit: str):
    """Both ranks gather an embedding unit then three FSDP units ``{unit}0..2`` in forward (step 0,
    then a reduce-scatter); in step 1 rank 1 skips the first two and gathers only the third."""
    a, b = ranks(2)
    for r in (a, b):
        r.coll("all_gather", (560,), phase=Phase.FORWARD, step=0, line=79)
        for e in range(3):
            r.coll("all_gather", (536,), phase=Phase.FORWARD, step=0, line=61, module=f"{unit}{e}")
        r.coll("reduce_scatter", (1120,), phase=Phase.BACKWARD, step=0, line=113)
        r.coll("all_gather", (560,), phase=Phase.FORWARD, step=1, line=79)
    a.coll("all_gather", (536,), phase=Phase.FORWARD, step=1, line=61, module=f"{unit}0")
    a.coll("all_gather", (536,), phase=Phase.FORWARD, step=1, line=61, module=f"{unit}1", done=False)
    b.coll("all_gather", (536,), phase=Phase.FORWARD, step=1, line=61, module=f"{unit}2")
    b.coll("reduce_scatter", (1072,), phase=Phase.BACKWARD, step=1, line=113, module=f"{unit}2", done=False)
    return run_of(a, b, hang=True)
