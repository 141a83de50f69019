"""Completion from Flight Recorder on a real Gloo job (2 ranks): ``benchmarks/nccl_completion.py``
under the recorder. Gloo's Flight Recorder entries never leave ``scheduled`` but are ``retired``
once done, and c10d collectives report through their Work; so the recorder's progress thread proves
the functional collectives (FSDP2's ``clip_grad_norm_``, ``funcol.all_reduce`` / ``all_gather_tensor``)
complete from Flight Recorder, and everything else from the Work."""

from __future__ import annotations

from moedoctor.analysis.loading.completion import completion_stats, source_of
from moedoctor.analysis.loading.load import load_run
from torchrun_util import REPO, assert_ok, recorded_env, run_command, torchrun_command

SCRIPT = REPO / "benchmarks" / "nccl_completion.py"


def test_functional_collectives_complete_through_flight_recorder_on_gloo(tmp_path):
    run_dir = tmp_path / "run"
    result = run_command(torchrun_command(SCRIPT, 2, "--backend", "gloo", "--steps", "2", "--plain", "3",
                                          "--settle", "1.5"), timeout=240, env=recorded_env(run_dir))
    assert_ok(result)
    assert "job (2 ranks): completion observed for" in result.output, result.tail()
    run = load_run(run_dir)
    for trace in run.traces:
        functional = [e for e in trace.events if e.raw_op.startswith("_c10d_functional")]
        c10d = [e for e in trace.events if not e.raw_op.startswith("_c10d_functional")]
        assert len(functional) == 2 + 3 * 2  # two clip_grad_norm_ all_reduces, then the plain ones
        assert all(source_of(trace, e) == "flight-recorder" for e in functional), \
            [(e.seq, e.op, source_of(trace, e)) for e in functional]
        assert all(source_of(trace, e) == "work" for e in c10d)
    stats = completion_stats(run.traces)
    assert stats.observed == stats.provable == stats.events and stats.by_source["flight-recorder"] == 16
