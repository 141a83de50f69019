"""``benchmarks/always_on.py`` runs end to end on a tiny setting (2 Gloo ranks, FSDP2, the native
recorder toggled in one process) and ends with its one-line result. No timing is asserted: the figures
of a two-step block say nothing; what is checked is that the whole loop ran, that the on blocks
recorded every collective they issued and the paused ones none, and the last line's format."""

from __future__ import annotations

import re
import sys

from torchrun_util import REPO, job_env, run_command

SCRIPT = REPO / "benchmarks" / "always_on.py"
LAST_LINE = re.compile(
    r"always-on: (\d+) collectives/step, training-thread CPU [+-]\d+\.\d\d% \(CI [+-]\d+\.\d\d\.\.[+-]\d+\.\d\d\), "
    r"step time [+-]\d+\.\d\d% \(CI [+-]\d+\.\d\d\.\.[+-]\d+\.\d\d\)"
)


def test_always_on_benchmark_runs_and_prints_its_line():
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--layers",
        "2",
        "--dim",
        "16",
        "--tokens",
        "8",
        "--pairs",
        "3",
        "--block",
        "2",
        "--warmup",
        "1",
    ]
    result = run_command(cmd, timeout=300, env=job_env(PYTHONPATH=str(REPO)), cwd=REPO)
    assert result.returncode == 0, result.tail()
    lines = [line for line in result.output.splitlines() if line.strip()]
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, result.tail()
    # 2 FSDP2 units and the root: an all-gather and a reduce-scatter each, the root's all-gather
    # skipped after forward ... whatever FSDP2 issues, it is the same every step, and counted.
    per_step = int(match.group(1))
    assert per_step > 0, result.tail()
    recorded = re.search(
        r"recorded: (\d+) collectives in the on blocks' steps \(issued (\d+)\), (\d+) in the "
        r"paused ones \(issued (\d+)\)",
        result.output,
    )
    assert recorded, result.tail()
    on, issued_on, off, issued_off = map(int, recorded.groups())
    assert on == issued_on == per_step * 3 * 2 and off == 0 and issued_off == issued_on, result.tail()


def test_pool_joins_the_pairs_of_several_dumps(tmp_path):
    """``--pool`` reads earlier runs' ``--dump`` files and prints the one line over all their pairs:
    two runs of 2 pairs each, the recorder costing exactly +10% CPU in every pair and nothing on the
    step, give +10.00% CPU (an interval of one point) and +0.00% step time over 4 pairs."""
    import json

    for i in range(2):
        (tmp_path / f"d{i}.json").write_text(
            json.dumps(
                {
                    "collectives_per_step": 145,
                    "cpu_on": [110.0, 220.0],
                    "cpu_off": [100.0, 200.0],
                    "step_on": [300.0, 400.0],
                    "step_off": [300.0, 400.0],
                }
            )
        )
    cmd = [sys.executable, str(SCRIPT), "--pool", str(tmp_path / "d0.json"), str(tmp_path / "d1.json")]
    result = run_command(cmd, timeout=60, env=job_env(PYTHONPATH=str(REPO)), cwd=REPO)
    assert result.returncode == 0, result.tail()
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "pooled: 2 runs, 4 pairs" in lines, result.tail()
    assert lines[-1] == (
        "always-on: 145 collectives/step, training-thread CPU +10.00% (CI +10.00..+10.00), "
        "step time +0.00% (CI +0.00..+0.00)"
    ), result.tail()
