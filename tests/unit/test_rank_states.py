"""Busy is not stuck: the rank states and the rule that judges a silence (``moedoctor.rank_states``),
on factory-built evidence; the stack reading that tells a wait from computation
(``run_records.communication_frame``); and the progress meters on real processes
(``runner.activity``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from moedoctor.rank_states import Pending, RankEvidence, RankState, Silence, judge
from moedoctor.run_records import Frame, communication_frame
from moedoctor.runner.activity import Activity, thread_cpu, thread_io

T = 20.0
ALLREDUCE = Pending("0", 3, "all_reduce", (0, 1), "ddp.py:15")
BARRIER = Pending("0", 9, "barrier", (0, 1, 2, 3), "train.py:53")


def waiting(rank: int, pending: Pending = ALLREDUCE, **kw) -> RankEvidence:
    return RankEvidence(rank, pending=pending, completion_tracked=True, stack_read=True, quiet_s=60.0, **kw)


def working(rank: int, quiet_s: float | None, where: str = "save (train.py:88)", **kw) -> RankEvidence:
    return RankEvidence(rank, stack_read=True, where=where, quiet_s=quiet_s, **kw)


# ---- states -----------------------------------------------------------------------------------


def test_states_from_evidence():
    assert RankEvidence(0, alive=False).state(T) == RankState.DEAD
    assert RankEvidence(0, frozen="T").state(T) == RankState.STOPPED
    # Disk sleep at every reading: stuck in the kernel only when nothing moved for the timeout; a rank
    # writing a checkpoint is in D between writes while its bytes move (found in the suite under load).
    assert RankEvidence(0, frozen="D", stack_read=True, quiet_s=60.0).state(T) == RankState.STOPPED
    assert RankEvidence(0, frozen="D", stack_read=True, quiet_s=0.3).state(T) == RankState.WORKING
    assert RankEvidence(0, stack_wait="all_reduce", stack_read=True, quiet_s=0.0).state(T) == RankState.WAITING
    # Issued, not completed, completion observed in its group, no progress: waits (work.wait() in its own code).
    assert waiting(0).state(T) == RankState.WAITING
    # Issued, not completed, but computing meanwhile, its stack moving (overlap): works.
    overlap = RankEvidence(0, pending=ALLREDUCE, completion_tracked=True, stack_read=True, stack_stable=False,
                           quiet_s=1.0)
    assert overlap.state(T) == RankState.WORKING
    # Issued, not completed, its CPU spinning in a CUDA synchronize (NCCL: loss.item()): the supervisor
    # leaves that CPU out of quiet_s, so it waits.
    spin = RankEvidence(0, pending=ALLREDUCE, completion_tracked=True, stack_read=True, stack_stable=True, quiet_s=30)
    assert spin.state(T) == RankState.WAITING
    # Issued (an FSDP2 reduce-scatter whose completion was never seen), computing at one stack (a DTensor
    # EMA in one long kernel): works, whatever the stacks look like.
    ema = RankEvidence(0, pending=ALLREDUCE, completion_tracked=True, stack_read=True, stack_stable=True, quiet_s=0.2)
    assert ema.state(T) == RankState.WORKING
    # Whether it progresses could not be told (native stack unreadable): nothing claimed.
    unsure = RankEvidence(0, pending=ALLREDUCE, completion_tracked=True, stack_read=True, quiet_s=None)
    assert unsure.state(T) == RankState.UNKNOWN
    # Pending, but completions are not observed there (NCCL without Flight Recorder): no claim of a wait.
    assert RankEvidence(0, pending=ALLREDUCE, stack_read=True, quiet_s=60.0).state(T) == RankState.WORKING
    assert RankEvidence(0, alive=None, pending=ALLREDUCE).state(T) == RankState.UNKNOWN


# ---- the rule ----------------------------------------------------------------------------------


def test_every_rank_working_is_busy_never_a_hang():
    j = judge([working(0, 0.5), working(1, 0.7)], T, 45.0)
    assert j.kind == Silence.BUSY and not j.proven
    assert "ranks 0,1 working in save (train.py:88)" in j.line and "no rank waits" in j.line


def test_every_rank_idle_outside_collectives_is_not_a_hang():
    j = judge([working(0, 60.0), working(1, 60.0)], T, 60.0)
    assert j.kind == Silence.BUSY and not j.proven


def test_rank0_saving_while_others_wait_at_a_barrier_is_busy():
    ev = [working(0, 0.2, cpu_s=3.2, io_bytes=2_100_000_000)] + [waiting(r, BARRIER) for r in (1, 2, 3)]
    j = judge(ev, T, 240.0)
    assert j.kind == Silence.BUSY
    assert "rank 0 working in save (train.py:88) (progressing: 3.2 s CPU, 2.1 GB I/O)" in j.line
    assert "ranks 1-3 wait in barrier #9 of group 0 (train.py:53)" in j.line


def test_straggler_without_progress_is_a_proven_hang():
    j = judge([waiting(0), working(1, 25.0, where="_read_shard (train.py:44)")], T, 25.0)
    assert j.proven
    assert "rank 0 waits in all_reduce #3 of group 0 (ddp.py:15) for 25 s" in j.line
    assert "rank 1 outside any collective in _read_shard (train.py:44)" in j.line
    assert "no CPU, no I/O, no new stack" in j.line


def test_waited_for_rank_progressing_is_busy_until_it_stops_progressing():
    assert judge([waiting(0), working(1, 3.0)], T, 100.0).kind == Silence.BUSY
    assert judge([waiting(0), working(1, 21.0)], T, 100.0).proven


@pytest.mark.parametrize("how", [{"frozen": "T"}, {"alive": False}])
def test_waited_for_rank_stopped_or_dead_is_proof(how):
    assert judge([waiting(0), RankEvidence(1, **how)], T, 30.0).proven


def test_every_member_inside_collectives_is_proof():
    j = judge([waiting(0), waiting(1)], T, 30.0)
    assert j.proven and j.states == {0: RankState.WAITING, 1: RankState.WAITING}


def test_missing_evidence_is_never_proof():
    # Another host's rank: only its trace (no pending collective) speaks for it here.
    j = judge([waiting(0), RankEvidence(1, alive=None)], T, 300.0)
    assert j.kind == Silence.UNPROVEN and "rank 1: no evidence" in j.line
    # A rank of the world that has no trace at all.
    j = judge([waiting(0, Pending("0", 3, "all_reduce"))], T, 300.0, world=range(2))
    assert j.kind == Silence.UNPROVEN
    # Progress not measured (no /proc readings).
    assert judge([waiting(0), working(1, None)], T, 300.0).kind == Silence.UNPROVEN


def test_only_the_waiting_ranks_group_matters():
    """Ranks 0 and 1 deadlock in their pair group; rank 2 (another group) progresses: still a hang."""
    pair = Pending("pair", 5, "all_reduce", (0, 1))
    j = judge([waiting(0, pair), working(1, 40.0), working(2, 0.1)], T, 40.0)
    assert j.proven


# ---- stacks: a wait, or computation --------------------------------------------------------------

TORCH = "/usr/lib/python3/site-packages/torch"


def frames(*specs: tuple[str, str]) -> tuple[Frame, ...]:
    return tuple(Frame(fn, path, 1) for fn, path in specs)


def test_a_collective_call_is_a_wait():
    f = frames(("all_reduce", f"{TORCH}/distributed/distributed_c10d.py"), ("wrapper", f"{TORCH}/distributed/c10d_logger.py"), ("step", "/job/train.py"))
    assert communication_frame(f).function == "all_reduce"


def test_fsdp_unshard_wait_is_a_wait():
    f = frames(("wait_for_unshard", f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_param_group.py"), ("forward", "/job/m.py"))
    assert communication_frame(f).function == "wait_for_unshard"


def test_dtensor_dispatch_is_computation():
    f = frames(
        ("_propagate_op_sharding", f"{TORCH}/distributed/tensor/_sharding_prop.py"),
        ("dispatch", f"{TORCH}/distributed/tensor/_dispatch.py"),
        ("__torch_dispatch__", f"{TORCH}/distributed/tensor/_api.py"),
        ("_foreach_lerp_", f"{TORCH}/_ops.py"),
        ("update_ema", "/job/train.py"),
    )
    assert communication_frame(f) is None


def test_a_launcher_wrapper_far_out_is_not_a_wait():
    f = frames(("save", "/job/train.py"), ("main", "/job/train.py"), ("wrapper", f"{TORCH}/distributed/elastic/multiprocessing/errors/__init__.py"))
    assert communication_frame(f) is None


# ---- progress meters on real processes ---------------------------------------------------------


def _child(code: str) -> subprocess.Popen:
    """A Python child that says "ready" once started (interpreter start-up is CPU, i.e. progress)."""
    proc = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\n" + code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def test_a_sleeping_process_makes_no_progress_a_spinning_one_does():
    sleeper = _child("import time; time.sleep(30)")
    spinner = _child("import time\nt = time.time()\nwhile time.time() - t < 30: pass")
    writer = _child(
        "import os, time\nf = open(os.devnull, 'wb')\nwhile True:\n    f.write(b'x' * 65536); f.flush(); time.sleep(0.05)"
    )
    try:
        activity = Activity()
        pids = {0: sleeper.pid, 1: spinner.pid, 2: writer.pid}
        activity.sample(pids)
        time.sleep(1.5)
        for _ in range(3):
            activity.sample(pids)
            time.sleep(0.3)
        assert activity.quiet(0) >= 2.0  # no CPU, no I/O since the first reading
        assert activity.quiet(1) < 1.0  # CPU
        assert activity.quiet(2) < 1.0  # bytes written
        assert activity.account(1)[0] > 0.3 and activity.account(2)[1] > 65536
        assert thread_cpu(sleeper.pid) is not None and thread_io(sleeper.pid) is not None
    finally:
        for p in (sleeper, spinner, writer):
            p.kill()
            p.wait()
    activity.sample({0: sleeper.pid})
    assert activity.quiet(0) is None  # gone: not measured, never "no progress"


def test_a_new_stack_is_progress_a_repeated_one_is_not():
    clock = [0.0]
    activity = Activity(clock=lambda: clock[0])
    activity.sample({0: 1})  # pid 1 is readable as root; what matters here is the stacks
    a, b = frames(("poll", "/job/a.py")), frames(("sleep", "/job/a.py"))
    clock[0] = 10.0
    assert not activity.note_stack(0, a)  # the first sample: where the silence found it
    clock[0] = 20.0
    assert activity.note_stack(0, b)
    clock[0] = 40.0
    assert not activity.note_stack(0, a) and not activity.note_stack(0, b)  # a polling loop: seen before


def test_a_wait_is_a_stack_that_stays_put():
    """A rank seen once in torch.distributed code is not yet known to wait; one whose stacks moved
    between samples (importing, computing through DTensor) works."""
    once = RankEvidence(0, stack_wait="all_reduce", stack_read=True, stack_stable=None, quiet_s=30.0)
    moved = RankEvidence(0, stack_wait="all_reduce", stack_read=True, stack_stable=False, quiet_s=0.1)
    assert once.state(T) == RankState.UNKNOWN and moved.state(T) == RankState.WORKING
    # Two ranks passing through torch.distributed code: never "every member inside the collective".
    j = judge([moved, RankEvidence(1, stack_wait="all_reduce", stack_read=True, stack_stable=False, quiet_s=0.1)],
              T, 30.0)
    assert j.kind == Silence.BUSY


def test_a_module_being_imported_is_not_a_wait():
    f = frames(("<module>", f"{TORCH}/distributed/fsdp/__init__.py"), ("_find_and_load", "<frozen importlib._bootstrap>"),
               ("__init__", f"{TORCH}/nn/parallel/distributed.py"), ("main", "/job/train.py"))
    assert communication_frame(f) is None


def test_cpu_spent_at_one_stack_in_a_device_synchronize_is_not_progress(monkeypatch):
    """A rank blocked on its GPU spins its CPU in cudaStreamSynchronize: ``quiet(cpu=False)`` counts only
    bytes moved and new stacks; the native frames name the wait (py-spy --native, faked here)."""
    import json as _json

    from moedoctor.runner import activity as act

    clock = [0.0]
    a = Activity(clock=lambda: clock[0])
    me = __import__("os").getpid()
    a.sample({0: me})
    clock[0] = 30.0
    a.meters[0].progressed = 29.0  # its CPU moved a second ago
    assert a.quiet(0) == 1.0 and a.quiet(0, cpu=False) == 30.0

    dump = [{"os_thread_id": me, "thread_name": "MainThread", "frames": [
        {"name": "0x7f00", "filename": "libcuda.so.1"},
        {"name": "cudaStreamSynchronize", "filename": "libcudart.so.12"},
        {"name": "at::native::_local_scalar_dense_cuda", "filename": "libtorch_cuda.so"},
        {"name": "main", "filename": "/job/train.py", "line": 70}]}]

    class Done:
        returncode, stdout = 0, _json.dumps(dump)

    monkeypatch.setattr(act.subprocess, "run", lambda *args, **kw: Done())
    assert act.device_wait(me, "py-spy") == "cudaStreamSynchronize"
    dump[0]["frames"] = [{"name": "at::native::cpublas::gemm", "filename": "libtorch_cpu.so"}]
    Done.stdout = _json.dumps(dump)
    assert act.device_wait(me, "py-spy") == ""  # real work in one long call
    Done.returncode = 1
    assert act.device_wait(me, "py-spy") is None  # could not be read


def test_dtensor_dispatch_looking_up_its_mesh_or_rank_is_computation():
    """DTensor's dispatch asks the device mesh for its coordinate and c10d for the rank on every op: a
    sample caught there (on every rank, twice in a row: an EMA over many DTensors) is no wait."""
    for innermost in (("get_coordinate", f"{TORCH}/distributed/device_mesh.py"),
                      ("get_rank", f"{TORCH}/distributed/distributed_c10d.py"),
                      ("_get_group_rank", f"{TORCH}/distributed/distributed_c10d.py")):
        f = frames(innermost, ("dispatch", f"{TORCH}/distributed/tensor/_dispatch.py"),
                   ("update_ema", "/job/train.py"))
        assert communication_frame(f) is None, innermost
