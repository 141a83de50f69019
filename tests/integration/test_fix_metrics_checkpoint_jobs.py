"""``metrics-after-microbatches`` and ``key-manifest-checkpoint`` injected into real jobs (torchrun,
Gloo, 2 ranks): the hanging fixtures run WITHOUT ``--apply-fix``, the fix named in
``MOEDOCTOR_FIXES`` with its checks on, and must exit 0 with both ranks' status saying the targets
were patched and called and the checks passed. Each job has a hard timeout; a failure shows the
job's log tail. The metrics wrappers' edge cases (a reducer that rejects the check's extra keys, a
metric whose meaning changes, where the metrics sit in the loop's result) run in this process.
"""

from __future__ import annotations

import re
from collections import namedtuple
from pathlib import Path

import pytest

from moedoctor.fixes.status import FixStatus, read_fix_status
from torchrun_util import (
    FIXTURES, JobResult, assert_ok, job_env, recorded_env, run_command, torchrun_command,
)

NPROC = 2
PG_TIMEOUT = ("--pg-timeout", "30")
JOB_TIMEOUT = 120.0
LOSS_LINE = re.compile(r"\[rank (\d+)\] step (\d+) loss (\d+\.\d+)")
StepOutput = namedtuple("StepOutput", "grad_norm metrics")


def run_job(name: str, *args: str, env: dict[str, str]) -> JobResult:
    return run_command(torchrun_command(FIXTURES / name / "train.py", NPROC, *PG_TIMEOUT, *args),
                       JOB_TIMEOUT, env=env)


def run_with_fix(name: str, fix: str, run_dir: Path, *args: str) -> tuple[JobResult, FixStatus]:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = recorded_env(run_dir, MOEDOCTOR_FIXES=fix, MOEDOCTOR_FIX_CHECKS="1")
    result = run_job(name, *args, env=env)
    assert_ok(result)
    return result, read_fix_status(run_dir, fix)


def plain_env() -> dict[str, str]:
    """No moedoctor on the path: the fixture must find what it needs by itself."""
    env = job_env()
    env.pop("PYTHONPATH", None)
    env.pop("MOEDOCTOR_FIXES", None)
    env.pop("MOEDOCTOR_RUN_DIR", None)
    return env


def losses(result: JobResult) -> dict[tuple[int, int], float]:
    """(rank, step) -> the logged loss metric."""
    return {(int(rank), int(step)): float(loss) for rank, step, loss in LOSS_LINE.findall(result.output)}


def assert_applied(status: FixStatus, result: JobResult, check: str) -> None:
    assert not status.problems, status.problems
    assert sorted(status.ranks) == list(range(NPROC)), f"status of ranks {sorted(status.ranks)}\n{result.tail()}"
    for rank, rank_status in status.ranks.items():
        for target in rank_status.targets:
            assert target.patched and target.calls > 0 and target.error is None, \
                f"rank {rank}: {target}\n{result.tail()}"
    runs = status.checks().get(check, [])
    assert sorted(rank for rank, _ in runs) == list(range(NPROC)), f"{check!r} ran on {runs}\n{result.tail()}"
    for rank, state in runs:
        assert state.passed is True and state.failures == 0, f"rank {rank}: {state}\n{result.tail()}"


# -- metrics-after-microbatches ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def metrics_fixed(tmp_path_factory) -> tuple[JobResult, FixStatus]:
    return run_with_fix("inflight_metric_allreduce", "metrics-after-microbatches",
                        tmp_path_factory.mktemp("metrics") / "run")


def test_metrics_fix_completes_the_hanging_job(metrics_fixed) -> None:
    result, status = metrics_fixed
    assert_applied(status, result, "metrics equal the in-loop reduction")
    logged = losses(result)
    assert set(logged) == {(r, s) for r in range(NPROC) for s in range(4)}, result.tail()  # past the fault
    for step in range(4):  # one reduction: every rank reports the same value
        assert logged[(0, step)] == logged[(1, step)], result.tail()
    for rank_status in status.ranks.values():
        calls = {t.path: t.calls for t in rank_status.targets}
        # Two micro-batches per step, four steps: the loop ran 4 times, the in-loop reduce 8 times.
        assert calls == {"__main__:train_step": 4, "__main__:all_reduce_metrics": 8}, calls


def test_metrics_fix_reports_what_the_unfixed_code_reports(metrics_fixed) -> None:
    result, _ = metrics_fixed
    reference = run_job("inflight_metric_allreduce", "--fault-step", "99", env=plain_env())
    assert_ok(reference)
    fixed, original = losses(result), losses(reference)
    for rank in range(NPROC):
        for step in (0, 1):  # before the fault step both runs take the same batches and routing
            assert fixed[(rank, step)] == pytest.approx(original[(rank, step)], rel=1e-6, abs=1e-6), \
                f"rank {rank} step {step}: {fixed[(rank, step)]} vs unfixed {original[(rank, step)]}"


# -- key-manifest-checkpoint ------------------------------------------------------------------------

def test_manifest_fix_saves_and_round_trips(tmp_path: Path) -> None:
    result, status = run_with_fix("uneven_dtensor_allgather", "key-manifest-checkpoint", tmp_path / "run",
                                  "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert_applied(status, result, "checkpoint round trip")
    for rank in range(NPROC):
        assert f"[rank {rank}] checkpoint saved" in result.output, result.tail()
        assert f"[rank {rank}] training done" in result.output, result.tail()
    # The last rank holds empty head shards, so its optimizer lacks the head's 4 AdamW moments.
    assert any("lacked 4 of 12 DTensor key(s)" in note for note in status.ranks[NPROC - 1].notes), \
        status.ranks[NPROC - 1].notes


def test_fixture_apply_fix_uses_the_moved_manifest_code(tmp_path: Path) -> None:
    result = run_job("uneven_dtensor_allgather", "--apply-fix", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     env=plain_env())
    assert_ok(result)
    for rank in range(NPROC):
        assert f"[rank {rank}] checkpoint round trip OK" in result.output, result.tail()


# -- the metrics wrappers in one process (no process group: nothing to agree with) ----------------

def install_metrics_fix(reduce, loop, *, checks: bool):
    """A module holding ``reduce`` and ``loop``, patched by the fix as a worker would patch it."""
    import sys
    import types

    from moedoctor.fixes import FIXES
    from moedoctor.fixes.runtime import FixRuntime

    name = f"moedoctor_test_metrics_{id(reduce)}"
    module = types.ModuleType(name)
    module.reduce, module.loop = reduce, loop
    sys.modules[name] = module
    fix = FIXES["metrics-after-microbatches"]
    runtime = FixRuntime(fix, fix.parse_config({"reduce": f"{name}:reduce", "loop": f"{name}:loop"}), None, checks)
    fix.install(runtime)
    assert set(runtime.targets) == {f"{name}:reduce", f"{name}:loop"}  # the fixture's names dropped
    assert all(t.patched for t in runtime.targets.values()), runtime.targets
    return module, runtime


def fake_ranks_reduce(calls: list, combine=lambda value: 2.0 * value):
    """Stands for a cross-rank reduction: ``combine`` each value with the other ranks' ones."""
    def reduce(metrics, scale_unused=None):
        calls.append(sorted(metrics))
        return {key: combine(value) for key, value in metrics.items()}
    return reduce


def make_loop(module_ref: list, values: list[float], returns=lambda metrics: (metrics, 0.5)):
    def loop():
        statuses = [module_ref[0].reduce({"loss": value, "tokens": 10.0 * value}, "cpu") for value in values]
        return returns({key: sum(s[key] for s in statuses) / len(statuses) for key in statuses[0]})
    return loop


def only_check(runtime):
    (check,) = runtime.checks.values()
    return check


@pytest.mark.parametrize("checks", [False, True])
def test_in_loop_reductions_become_one_after_the_loop(checks: bool) -> None:
    calls: list = []
    ref: list = []
    module, runtime = install_metrics_fix(fake_ranks_reduce(calls), make_loop(ref, [1.0, 2.0, 4.0]), checks=checks)
    ref.append(module)
    metrics, norm = module.loop()
    assert metrics == {"loss": pytest.approx(2.0 * 7 / 3), "tokens": pytest.approx(20.0 * 7 / 3)}
    assert norm == 0.5 and len(calls) == 1  # one reduction per step, after the loop
    if checks:
        assert "mb2@loss" in calls[0] and "mb0@tokens" in calls[0]  # the extra keys ride along
        assert only_check(runtime).passed is True, only_check(runtime)
    else:
        assert calls == [["loss", "tokens"]] and not runtime.checks
    assert module.reduce({"loss": 3.0}) == {"loss": 6.0} and len(calls) == 2  # outside the loop: unchanged


def test_check_reports_a_metric_whose_meaning_changes() -> None:
    calls: list = []
    ref: list = []
    # MAX against another rank's 3.0: the mean of per-micro-batch maxima is not the max of the mean.
    module, runtime = install_metrics_fix(fake_ranks_reduce(calls, combine=lambda v: max(v, 3.0)),
                                          make_loop(ref, [1.0, 5.0]), checks=True)
    ref.append(module)
    metrics, _ = module.loop()
    assert metrics["loss"] == 3.0
    check = only_check(runtime)
    assert check.passed is False and "loss: 3.0 after the loop vs 4.0 in the loop" in check.detail, check


def test_check_survives_a_reducer_that_rejects_extra_keys() -> None:
    calls: list = []
    ref: list = []
    plain = fake_ranks_reduce(calls)

    def strict(metrics, device=None):
        if any("@" in key for key in metrics):
            raise KeyError("unknown metric")
        return plain(metrics)

    module, runtime = install_metrics_fix(strict, make_loop(ref, [1.0, 3.0]), checks=True)
    ref.append(module)
    metrics, _ = module.loop()
    assert metrics == {"loss": 4.0, "tokens": 40.0}
    check = only_check(runtime)
    assert check.passed is None and "rejected" in check.detail, check


@pytest.mark.parametrize("returns", [
    lambda metrics: metrics,
    lambda metrics: [0.5, metrics],
    lambda metrics: StepOutput(0.5, metrics),
])
def test_the_metrics_are_found_in_the_loops_result(returns) -> None:
    calls: list = []
    ref: list = []
    module, _ = install_metrics_fix(fake_ranks_reduce(calls), make_loop(ref, [1.0, 3.0], returns), checks=False)
    ref.append(module)
    result = module.loop()
    expected = returns({"loss": 4.0, "tokens": 40.0})
    assert type(result) is type(expected) and result == expected


def test_a_failing_loop_leaves_reduce_as_it_was() -> None:
    calls: list = []
    ref: list = []

    def loop():
        ref[0].reduce({"loss": 1.0})
        raise RuntimeError("out of memory")

    module, _ = install_metrics_fix(fake_ranks_reduce(calls), loop, checks=False)
    ref.append(module)
    with pytest.raises(RuntimeError):
        module.loop()
    assert module.reduce({"loss": 1.0}) == {"loss": 2.0} and len(calls) == 1
