"""Slow, not stuck (``moedoctor.analysis.evidence.timing``): storms of small collectives from factory-built
events, the report's section, the live status line's watch, and the fix's bucketing."""

from __future__ import annotations

import dataclasses
import json

import pytest
from event_factory import manifest, ranks, run_of

from moedoctor.analysis import Verdict, analyze
from moedoctor.analysis.evidence import timing
from moedoctor.analysis.evidence.timing import MIN_STORM_COUNT, StormWatch, event_bytes, rank_storms, slow_report
from moedoctor.events import Phase
from moedoctor.fixes.coalesce_broadcasts import Buckets, _parse_config
from moedoctor.fixes.base import FixConfigError
from moedoctor.render.json_report import report_to_dict

LOADER = dict(file="/job/train.py", line=38, function="load_full_state")


def storm_run(n: int = 1500, shape=(16, 32), big: bool = True, command=("torchrun", "/job/train.py")):
    """Rank 0 broadcasts ``n`` tensors one by one (1 ms apart: the factory's clock), then FSDP2-like
    steps with a 4 MB all-gather (the bandwidth reference) when ``big``."""
    builders = ranks(2)
    for b in builders:
        for _ in range(n):
            b.coll("broadcast", shape, root=0, **LOADER)
        for step in range(2):
            b.coll("all_gather", (1 << 20,) if big else (64,), phase=Phase.FORWARD, step=step, line=115)
            b.coll("all_gather", (1 << 20,) if big else (64,), phase=Phase.BACKWARD, step=step, line=116)
            b.coll("reduce_scatter", (1 << 20,) if big else (64,), phase=Phase.BACKWARD, step=step, line=116)
    info = dataclasses.replace(manifest(exits={0: 0, 1: 0}, hang=False), command=list(command))
    return run_of(*builders, manifest_info=info)


def fsdp_run(steps: int = 50, layers: int = 24):
    """A healthy FSDP2 stream: per step one all-gather per layer in forward, all-gather + reduce-scatter
    per layer in backward, small tensors (the per-layer all-gathers at 2 ranks)."""
    builders = ranks(2)
    for b in builders:
        for step in range(steps):
            for _ in range(layers):
                b.coll("all_gather", (256,), phase=Phase.FORWARD, step=step, line=115)
            for _ in range(layers):
                b.coll("all_gather", (256,), phase=Phase.BACKWARD, step=step, line=116)
                b.coll("reduce_scatter", (512,), phase=Phase.BACKWARD, step=step, line=116)
            b.coll("all_reduce", (1,), phase=Phase.OPTIMIZER, step=step, line=117)
    return run_of(*builders, manifest_info=manifest(exits={0: 0, 1: 0}, hang=False))


def test_storm_found_with_call_site_count_time_and_gain():
    report = analyze(storm_run())
    assert report.verdict == Verdict.HEALTHY  # slow, not stuck: nothing is wrong between the ranks
    slow = report.slow
    assert slow is not None and len(slow.storms) == 1
    s = slow.storms[0]
    assert (s.op, s.call_site, s.function, s.count, s.ranks) == ("broadcast", "/job/train.py:38", "load_full_state",
                                                                   1500, (0, 1))
    assert s.seconds == pytest.approx(1.5, rel=0.01) and s.per_collective_s == pytest.approx(0.001, rel=0.01)
    assert s.bytes == 1500 * 16 * 32 * 4 and s.latency_bound
    # Bandwidth measured on the 4 MB all-gather (0.5 ms to complete): 3 MB at 8 GB/s + 1 latency.
    assert s.gain.weak is None and "measured" in s.gain.method and "all_gather" in s.gain.method
    assert s.gain.coalesced_s == pytest.approx(0.001 + s.bytes / (4 * (1 << 20) / 0.0005), rel=0.05)
    assert s.gain.gain_s == pytest.approx(s.seconds - s.gain.coalesced_s)
    assert "1,500 broadcasts from train.py:38 in 1.5 s (latency-bound)" in slow.summary()
    # Time by phase: the storm's phase and call site is a row with its count and spacing.
    row = next(p for p in slow.phases if p.call_site == "/job/train.py:38")
    assert (row.phase, row.count) == ("other", 1500) and row.mean_interval_s == pytest.approx(0.001, rel=0.01)
    # The fix is offered, pointed at the script's function.
    assert report.fixes == ["coalesce-broadcasts"]
    assert report.fix_config == {"coalesce-broadcasts": {"targets": ["__main__:load_full_state"]}}
    assert report.verify_command.startswith("moedoctor verify --fix coalesce-broadcasts --run")
    doc = json.loads(json.dumps(report_to_dict(report)))
    assert doc["slow"]["pattern"] == "broadcast-storm" and doc["slow"]["storms"][0]["call_site"] == "/job/train.py:38"
    assert doc["slow"]["storms"][0]["count"] == 1500 and doc["slow"]["storms"][0]["latency_bound"] is True


def test_no_storm_on_a_normal_fsdp2_stream():
    report = analyze(fsdp_run())
    assert report.verdict == Verdict.HEALTHY and report.slow is None and report.fixes == []
    assert report_to_dict(report)["slow"] is None


def test_weak_estimate_without_a_large_collective_says_so():
    s = slow_report(storm_run(big=False).traces).storms[0]
    assert s.gain.weak and "no collective of 1 MB or more" in s.gain.weak and "assumed 1 GB/s (cpu)" in s.gain.method


def test_fix_target_only_for_code_it_can_name():
    # A library function (installed package) is named by its module; a file that is neither the
    # script nor a package gives no target (the report says to use --config).
    lib = dict(file="/usr/lib/python3/site-packages/accel/utils.py", line=9, function="sync_states")
    builders = ranks(2)
    for b in builders:
        for _ in range(MIN_STORM_COUNT + 600):
            b.coll("broadcast", (8,), root=0, **lib)
    info = dataclasses.replace(manifest(exits={0: 0, 1: 0}, hang=False), command=["torchrun", "train.py"])
    report = analyze(run_of(*builders, manifest_info=info))
    assert report.fix_config == {"coalesce-broadcasts": {"targets": ["accel.utils:sync_states"]}}
    report = analyze(storm_run(command=("torchrun", "/job/other.py")))
    assert report.slow is not None and report.fix_config is None and report.fixes == []


@pytest.mark.parametrize(
    ("count", "shape", "found"),
    [
        (MIN_STORM_COUNT, (16,), False),  # 500 records 1 ms apart: 0.5 s, under MIN_STORM_SECONDS
        (1001, (16,), True),  # just over a second
        (999, (16,), False),  # just under
        (1500, (1 << 18,), True),  # 1 MiB each: at SMALL_BYTES, still small
        (1500, ((1 << 18) + 1,), False),  # over SMALL_BYTES: bandwidth-bound transfers, not a storm
    ],
)
def test_threshold_edges(count, shape, found):
    b = ranks(2)[0]
    for _ in range(count):
        b.coll("broadcast", shape, root=0, **LOADER)
    assert bool(rank_storms(0, b.events)) is found


def test_count_threshold_even_when_slow():
    b = ranks(2)[0]
    for _ in range(MIN_STORM_COUNT - 1):
        b.coll("broadcast", (16,), root=0, **LOADER)
        b.time += 0.01  # 11 ms apart: 5 s in all, but fewer than MIN_STORM_COUNT calls
    assert rank_storms(0, b.events) == []


def test_a_run_is_broken_by_another_call_site_or_op():
    b = ranks(2)[0]
    for i in range(1600):
        b.coll("broadcast", (16,), root=0, line=38 if i % 2 else 39)
    assert rank_storms(0, b.events) == []


def test_bytes_count_the_larger_side_and_the_dtype():
    b = ranks(2)[0]
    b.coll("all_gather", (10,), out_shapes=((10,), (10,)), dtype="bfloat16")
    assert event_bytes(b.events[0]) == 40


def test_live_watch_line_after_three_seconds_of_storm():
    b = ranks(2)[0]
    watch = StormWatch()
    for i in range(4000):
        b.coll("broadcast", (16,), root=0, **LOADER)
        watch.feed(b.events[-1])
        if i == 2500:
            assert watch.line() is None  # 2.5 s: not yet
    line = watch.line()
    assert line is not None and line.startswith("slow, not stuck: 4,000 broadcasts from train.py:38 in 4 s")
    b.coll("all_reduce", (1,), line=40)
    watch.feed(b.events[-1])
    assert watch.line() is None  # the storm is over


def test_buckets_split_at_the_limit_and_per_key():
    buckets = Buckets(100)
    assert buckets.add("a", 1, 60) is None
    assert buckets.add("b", 2, 60) is None  # another key: its own bucket
    assert buckets.add("a", 3, 40) is None  # exactly full
    assert buckets.add("a", 4, 1) == [1, 3]  # does not fit: the full bucket comes back to flush first
    assert buckets.add("a", 5, 500) == [4]  # larger than the limit: alone
    assert buckets.drain() == [("b", [2]), ("a", [5])] and not buckets


def test_fix_config_is_validated():
    assert _parse_config({"targets": "__main__:load"}) == {"targets": ["__main__:load"], "bucket_mb": 500.0}
    with pytest.raises(FixConfigError):
        _parse_config({"bucket_mb": 0})
    with pytest.raises(FixConfigError):
        _parse_config({"target": "x:y"})
    assert timing.BUCKET_BYTES == 500 << 20


def test_a_library_call_at_the_call_site_gets_no_fix_target(tmp_path):
    # set_model_state_dict(..., broadcast_from_rank0=True) broadcasts per key inside torch and slices
    # each result at once: deferring those would read stale data, so the fix is not offered there.
    script = tmp_path / "load.py"
    script.write_text("def load_checkpoint(model, sd, opts):\n    set_model_state_dict(model, sd, options=opts)\n"
                      "def sync(model):\n    for t in model.state_dict().values():\n        dist.broadcast(t, src=0)\n")
    for line, function, offered in ((2, "load_checkpoint", False), (5, "sync", True)):
        builders = ranks(2)
        for b in builders:
            for _ in range(1200):
                b.coll("broadcast", (8,), root=0, file=str(script), line=line, function=function)
        info = dataclasses.replace(manifest(exits={0: 0, 1: 0}, hang=False), command=["torchrun", str(script)])
        report = analyze(run_of(*builders, manifest_info=info))
        assert report.slow is not None and timing.direct_call(report.slow.storms[0]) is offered
        assert (report.fixes == ["coalesce-broadcasts"]) is offered
        if offered:
            assert report.fix_config == {"coalesce-broadcasts": {"targets": ["__main__:sync"]}}


def test_status_line_says_slow_not_stuck_with_the_longest_rank_storm():
    from moedoctor.cli.live import status_line
    from moedoctor.runner.launch import RankStatus, RunStatus

    b = ranks(2)[0]
    b.coll("broadcast", (16,), root=0, **LOADER)
    e = b.events[-1]
    quiet = RunStatus(12.0, 0.1, 180.0, [RankStatus(0, 10, e, False, 0.1), RankStatus(1, 11, e, False, 0.1)])
    assert "slow, not stuck" not in status_line(quiet)
    ranks_ = [RankStatus(0, 10, e, False, 0.1, slow="slow, not stuck: 900 broadcasts", slow_seconds=3.2),
              RankStatus(1, 11, e, False, 0.1, slow="slow, not stuck: 4,000 broadcasts", slow_seconds=9.0)]
    line = status_line(RunStatus(12.0, 0.1, 180.0, ranks_))
    assert "| slow, not stuck: 4,000 broadcasts | rank 0: broadcast #1" in line


def _interrupted(gap: float):
    """Both ranks in a broadcast loop, stopped by Ctrl-C: rank 0 (the root) one broadcast ahead; rank
    1's last broadcast ``gap`` seconds before rank 0's."""
    a, b = ranks(2)
    for _ in range(1200):
        a.coll("broadcast", (16,), root=0, **LOADER)
        b.coll("broadcast", (16,), root=0, **LOADER)
    a.time += gap
    a.coll("broadcast", (16,), root=0, done=False, **LOADER)
    info = dataclasses.replace(manifest(exits={0: None, 1: None}, hang=False), status="interrupted")
    return run_of(a, b, manifest_info=info)


def test_an_interrupted_storm_is_in_flight_not_a_desync():
    report = analyze(_interrupted(0.0))
    # nothing wrong up to the stop, but the run did not end: no verdict on the job
    assert report.verdict == Verdict.INTERRUPTED and report.pattern is None, report.summary
    assert any("interrupted while every rank was still issuing" in line for line in report.incomplete)
    assert report.slow is not None and report.slow.storms[0].count >= 1200


def test_an_interrupted_run_whose_rank_stopped_long_before_keeps_its_divergence():
    report = analyze(_interrupted(5.0))  # rank 1 issued nothing for 5 s before the stop: stuck
    assert report.verdict != Verdict.HEALTHY and report.divergence is not None, report.summary


def test_a_gap_in_the_event_ids_ends_a_run():
    # The streaming path loads windows of a large trace: two windows of the same loop are not one run.
    b = ranks(2)[0]
    for _ in range(1600):
        b.coll("broadcast", (16,), root=0, **LOADER)
    windows = b.events[:800] + b.events[801:]
    assert [len(r) for r in timing.runs(windows)] == [800, 799]
    assert [s.count for s in rank_storms(0, b.events)] == [1600]


def test_fix_target_of_a_method_is_class_dot_method(tmp_path):
    # Megatron-style DistributedDataParallel.broadcast_params: the site's function is the method's
    # co_name; the target must be its qualified name, or the fix finds nothing to patch. A function
    # defined inside another is a new object each call: no target.
    script = tmp_path / "train.py"
    script.write_text(
        "class DDP:\n"
        "    def broadcast_params(self):\n"
        "        for p in self.params:\n"
        "            dist.broadcast(p, src=0)\n"
        "def outer():\n"
        "    def inner():\n"
        "        dist.broadcast(x, src=0)\n"
    )
    for line, function, target in ((4, "broadcast_params", "__main__:DDP.broadcast_params"), (7, "inner", None)):
        builders = ranks(2)
        for b in builders:
            for _ in range(MIN_STORM_COUNT + 600):
                b.coll("broadcast", (8,), root=0, file=str(script), line=line, function=function)
        info = dataclasses.replace(manifest(exits={0: 0, 1: 0}, hang=False), command=["torchrun", str(script)])
        report = analyze(run_of(*builders, manifest_info=info))
        expected = {"coalesce-broadcasts": {"targets": [target]}} if target else None
        assert report.slow is not None and report.fix_config == expected


def test_html_report_has_the_slow_busy_and_params_sections():
    import re

    from moedoctor.render.html import html_page
    from moedoctor.run_records import BusyRecord

    report = analyze(storm_run())
    busy = BusyRecord(start=0.0, seconds=42.0, kind="busy", line="rank 0 working in save (train.py:88)", ended=True)
    params = {"ranks": [0, 1], "points": ["prepared"], "findings": [], "notes": []}
    page = html_page(dataclasses.replace(report, busy=[busy]), params=params)
    assert '<h2 id="slow">Slow, not stuck (broadcast-storm)</h2>' in page
    assert re.search(r"<td>outside forward/backward</td><td><code>broadcast</code></td>", page)
    assert '<h2 id="busy">' in page and "42 s without a collective: rank 0 working in save" in page
    assert '<h2 id="params">Parameter check</h2>' in page and "consistent" in page
    assert '<h2 id="slow">' not in html_page(analyze(fsdp_run(steps=2)))
