"""The exception record (``x``) and the ``checkpoint-recompute-mismatch`` pattern.

The record is built from real exceptions (a real ``torch.utils.checkpoint`` recompute that saves
fewer tensors than its forward), checked against the schema and read back; the pattern runs on
factory-built runs."""

from __future__ import annotations

import json
import sys
import threading
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from event_factory import manifest, ranks, run_of
from moedoctor.analysis import analyze
from moedoctor.analysis.model import Verdict
from moedoctor.analysis.patterns import checkpoint_recompute_mismatch as crm
from moedoctor.events import CheckpointedFunction, Phase
from moedoctor.recorder import exceptions
from moedoctor.trace import format as fmt
from moedoctor.trace import schema
from moedoctor.trace.reader import TraceFile, decode_exception

COUNT_MESSAGE = (
    "torch.utils.checkpoint: A different number of tensors was saved during the original forward and "
    "recomputation.\nNumber of tensors saved during forward: 85\nNumber of tensors saved during recomputation: 53.\n"
)
CKPT = "/site-packages/torch/utils/checkpoint.py"
AUTOGRAD = "/site-packages/torch/autograd/graph.py"
FRAMES = (
    ("/job/train.py", 118, "<module>"),
    ("/job/train.py", 109, "main"),
    (AUTOGRAD, 979, "_engine_run_backward"),
    (CKPT, 1187, "unpack_hook"),
    (CKPT, 879, "check_recomputed_tensors_match"),
)
MOE_LAYER = CheckpointedFunction("Layer._forward", "/job/model.py", 72, "Layer", ("mlp.experts:4",))


class Sparse(nn.Module):
    """Runs as many of its members as ``active`` says, and changes ``active`` in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.active = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for expert in self.experts[: self.active]:
            out = out + expert(x).relu()
        self.active -= 1  # routing state changed inside the forward: the recompute runs fewer
        return out


def checkpoint_error() -> BaseException:
    block = Sparse()
    x = torch.randn(2, 4, requires_grad=True)
    try:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("the recompute did not raise")


def test_a_real_checkpoint_error_round_trips_through_the_schema(tmp_path):
    error = checkpoint_error()
    record = exceptions.exception_record(type(error), error, error.__traceback__, "MainThread", 3)
    assert schema.problems(json.loads(fmt.encode(record))) == []
    header = {"format": "moedoctor-trace", "version": 1, "rank": 1, "local_rank": 1, "world_size": 2,
              "host": "h", "pid": 1, "torch": "2.13", "moedoctor": "0.1.0", "start_time": 1.0}
    path = tmp_path / "rank-00001.jsonl"
    path.write_bytes(fmt.encode(header) + fmt.encode(record))
    (exc,) = list(TraceFile(path))
    assert exc.type == "torch.utils.checkpoint.CheckpointError" and exc.name == "CheckpointError"
    assert exc.rank == 1 and exc.step == 3 and exc.phase == Phase.BACKWARD and exc.thread == "MainThread"
    assert "different number of tensors" in exc.message
    assert exc.frames[0].file == __file__ and exc.frames[0].function == "checkpoint_error"
    assert exc.frames[-1].file.endswith("torch/utils/checkpoint.py")
    assert exc.checkpointed is not None
    assert exc.checkpointed.function == "Sparse.forward" and exc.checkpointed.module == "Sparse"
    assert exc.checkpointed.file == __file__ and exc.checkpointed.module_lists == ("experts:3",)
    assert crm.checkpoint_exception(exc)
    assert crm.what_differed(exc.message) == "9 tensors saved in forward, 6 in recompute (fewer in recompute)"


def test_the_record_is_bounded():
    def deep(n: int) -> None:
        if n == 0:
            raise ValueError("x" * 5000)
        deep(n - 1)

    try:
        deep(100)
    except ValueError as e:
        record = exceptions.exception_record(type(e), e, e.__traceback__, "T", 0)
    assert schema.problems(json.loads(fmt.encode(record))) == []
    assert len(record["msg"]) == schema.MAX_MESSAGE and record["msg"].endswith("...")
    assert len(record["tb"]) == schema.MAX_FRAMES and record["cut"] == 101 + 1 - schema.MAX_FRAMES
    assert record["tb"][0][2] == "test_the_record_is_bounded" and record["type"] == "ValueError"
    assert record["ph"] == "other" and "ckpt" not in record
    v = decode_exception(json.loads(fmt.encode(record)), 0)
    assert v.frames_left_out == record["cut"] and v.checkpointed is None
    bad = dict(record, tb=[["f", "1", "g"]])
    assert schema.problems(bad) and pytest.raises(TypeError, decode_exception, bad, 0)


def test_hooks_record_then_chain_to_the_previous_ones(monkeypatch):
    written, printed = [], []
    recorder = types.SimpleNamespace(paused=False, is_open=True, step=5, checkpoint=None, write_record=written.append)
    monkeypatch.setattr(sys, "excepthook", lambda *a: printed.append(a[0]))
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_type))
    exceptions.install(recorder)
    exceptions.install(recorder)  # a second install does not wrap again
    try:
        raise KeyError("k")
    except KeyError as e:
        sys.excepthook(type(e), e, e.__traceback__)
    thread = threading.Thread(target=lambda: 1 / 0, name="loader")
    thread.start()
    thread.join()
    assert printed == [KeyError, ZeroDivisionError]
    assert [(r["type"], r["th"], r["step"]) for r in written] == [("KeyError", "MainThread", 5),
                                                                  ("ZeroDivisionError", "loader", 5)]
    recorder.is_open = False  # no trace open: nothing written, still printed
    sys.excepthook(ValueError, ValueError("v"), None)
    assert len(written) == 2 and printed[-1] is ValueError


def crashed_run(exc_args: dict | None, exits=None):
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (3248,), phase=Phase.FORWARD, step=step, module="layers.1")
            r.coll("all_gather", (3248,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1")
        a.coll("reduce_scatter", (6496,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1",
               done=step < 2)
        if step < 2:
            b.coll("reduce_scatter", (6496,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1")
    if exc_args is not None:
        b.exc(**{"type_": "torch.utils.checkpoint.CheckpointError", "message": COUNT_MESSAGE, "frames": FRAMES,
                 "step": 2, "checkpointed": MOE_LAYER, **exc_args})
    return analyze(run_of(a, b, manifest_info=manifest(exits or {0: -15, 1: 1}, hang=False)))


def test_the_crash_is_named_with_the_counts_and_the_checkpointed_module():
    report = crashed_run({})
    assert report.verdict == Verdict.CRASHED and report.pattern == "checkpoint-recompute-mismatch"
    assert report.culprit_ranks == [1] and report.fixes == ["expert-dense"]
    assert report.summary.startswith("Crashed: rank 1 died (exit 1) first; rank 0 then ended (SIGTERM).")
    text = "\n".join(report.evidence)
    assert "rank 1 raised torch.utils.checkpoint.CheckpointError at train.py:109 (main) in backward of step 2" in text
    assert "85 tensors saved in forward, 53 in recompute (fewer in recompute)" in text
    assert "checkpointed region: Layer._forward of Layer (model.py:72)" in text
    assert "mlp.experts (4 members)" in text
    assert "rank 0 waits in reduce_scatter" in text
    assert sum("rank 1 raised" in e for e in report.evidence) == 1  # not repeated by the crash lines
    assert report.suggestion.call_site == "/job/model.py:72"
    (candidate,) = report.candidates
    assert candidate.score == 0.8


def test_missing_evidence_lowers_the_score_and_says_why():
    no_lists = CheckpointedFunction("Layer._forward", "/job/model.py", 72, "Layer", ())
    report = crashed_run({"checkpointed": no_lists, "message": "torch.utils.checkpoint: something else"})
    assert report.pattern == "checkpoint-recompute-mismatch"
    assert report.candidates[0].score == pytest.approx(0.45)
    text = "\n".join(report.evidence)
    assert "holds no list of same-class members" in text and "does not say what differed" in text
    report = crashed_run({"checkpointed": None, "phase": Phase.FORWARD})
    assert report.candidates[0].score == pytest.approx(0.5)
    assert "not recorded" in "\n".join(report.evidence) and "not in backward" in "\n".join(report.evidence)


def test_structure_not_names_decides():
    # Same message, raised by the job's own code: not torch.utils.checkpoint's.
    own = crashed_run({"type_": "RuntimeError", "frames": FRAMES[:2]})
    assert own.verdict == Verdict.CRASHED and own.pattern is None
    assert any(e.startswith("rank 1 raised RuntimeError at train.py:109 (main)") for e in own.evidence)
    # A RuntimeError from checkpoint's unpack hook (an internal assert) still counts: the frames say so.
    hook = crashed_run({"type_": "RuntimeError", "message": "Internal error"})
    assert hook.pattern == "checkpoint-recompute-mismatch"
    # A collective failing inside a recompute passes through checkpoint's hooks but is not raised there.
    collective = FRAMES[:4] + (("/site-packages/torch/distributed/distributed_c10d.py", 4943, "all_gather"),)
    inside = crashed_run({"type_": "RuntimeError", "message": "Connection closed by peer", "frames": collective})
    assert inside.pattern is None
    # A tensor unpacked twice is a double backward, not a recompute that differed.
    twice = crashed_run({"message": "torch.utils.checkpoint: Unpack is being triggered for a tensor that was "
                                    "already unpacked once."})
    assert twice.pattern is None


def test_no_exception_recorded_stays_a_crash():
    report = crashed_run(None, exits={0: -15, 1: -9})
    assert report.verdict == Verdict.CRASHED and report.pattern is None
    assert not any("raised" in e for e in report.evidence)


def test_metadata_and_more_tensors_messages():
    meta = ("torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than "
            "during the forward pass.\ntensor at position 12:\nsaved metadata: {'shape': torch.Size([9, 16]), "
            "'dtype': torch.float32, 'device': device(type='cpu')}\nrecomputed metadata: {'shape': "
            "torch.Size([11, 16]), 'dtype': torch.float32, 'device': device(type='cpu')}\n")
    assert crm.what_differed(meta) == (
        "1 saved tensor(s) of other metadata in recompute: [9, 16] in forward, [11, 16] in recompute")
    more = ("torch.utils.checkpoint: trying to save more tensors during recomputation than during the original "
            "forward pass.")
    assert crm.what_differed(more) == "more tensors saved in recompute than in forward"
    assert crm.what_differed("anything else") is None


def test_every_rank_raised_and_none_waits():
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (3248,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1")
    for r in (a, b):
        r.exc("torch.utils.checkpoint.CheckpointError", COUNT_MESSAGE, FRAMES, step=2, checkpointed=MOE_LAYER)
    report = analyze(run_of(a, b, manifest_info=manifest({0: 1, 1: 1}, hang=False)))
    assert report.verdict == Verdict.CRASHED and report.pattern == "checkpoint-recompute-mismatch"
    assert report.candidates[0].score == pytest.approx(0.6) and report.culprit_ranks == [0, 1]
    assert any("no rank is left waiting" in e for e in report.evidence)
    assert "rank 0 raised torch.utils.checkpoint.CheckpointError" in report.summary


class Fused(nn.Module):
    """Its experts stacked in two parameters (``w1[e]``, ``w2[e]``); runs fewer of them each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.w1 = nn.Parameter(torch.randn(3, 4, 8))
        self.w2 = nn.Parameter(torch.randn(3, 8, 4))
        self.active = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm(x)
        for e in range(self.active):
            out = out + (x @ self.w1[e]).relu() @ self.w2[e]
        self.active -= 1
        return out


def test_experts_stacked_in_parameters_are_recorded_and_count_as_members():
    """A real recompute error from a block with fused experts records ``{w1,w2}:3``; the pattern then
    does not lower the score as for a region without experts (the norm's 1-D weights are not stacked)."""
    block, x = Fused(), torch.randn(2, 4, requires_grad=True)
    try:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    except Exception as e:  # noqa: BLE001
        error = e
    else:
        raise AssertionError("the recompute did not raise")
    record = exceptions.exception_record(type(error), error, error.__traceback__, "MainThread", 2)
    assert record["ckpt"][4] == ["{w1,w2}:3"]
    fused = CheckpointedFunction("Layer.forward", "/job/model.py", 72, "Layer", ("moe.{w1,w2}:8",))
    report = crashed_run({"checkpointed": fused})
    assert report.pattern == "checkpoint-recompute-mismatch" and report.candidates[0].score == 0.8
    assert any("stacked in parameters" in e and "moe.{w1,w2} (8 members)" in e for e in report.evidence)


def test_a_rank_whose_collective_failed_once_the_culprit_died_counts_as_waiting():
    """Gloo completes rank 0's reduction with an error ("Connection closed by peer") when rank 1 dies:
    the work reads as completed, but rank 0 raised after issuing it and issued nothing more."""
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_gather", (3248,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1")
        a.coll("reduce_scatter", (6496,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1")
        if step < 2:
            b.coll("reduce_scatter", (6496,), phase=Phase.BACKWARD, step=step, line=109, module="layers.1")
    b.exc("torch.utils.checkpoint.CheckpointError", COUNT_MESSAGE, FRAMES, step=2, checkpointed=MOE_LAYER)
    a.exc("RuntimeError", "Connection closed by peer", FRAMES[:3], step=2)
    report = analyze(run_of(a, b, manifest_info=manifest({0: -15, 1: 1}, hang=False)))
    assert report.pattern == "checkpoint-recompute-mismatch" and report.candidates[0].score == 0.8
    assert any("rank 0 until it failed" in e for e in report.evidence), report.evidence
