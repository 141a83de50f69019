"""What the benchmarks that toggle the recorder in one process print: paired differences and the
native kernel's own clock.

Toggled measurements alternate blocks (recorder on, then paused, then on...). Comparing the median
of all "on" blocks with the median of all "paused" ones lets slow drift (clocks, other jobs on the
host) land on either side; pairing each "on" block with the "paused" block right after it cancels
drift slower than a block, and the spread of the pairs' differences says how far the result can be
trusted: ``paired`` gives their median and a bootstrap 95% interval of that median.
"""

from __future__ import annotations

import random
import statistics


def paired(on: list[float], off: list[float], relative: bool = True, draws: int = 2000) -> tuple[float, float, float, int]:
    """(median difference, 2.5th and 97.5th percentile of its bootstrap, pairs) of on[i] against
    off[i] (relative: in percent of off[i])."""
    pairs = min(len(on), len(off))
    if pairs == 0:
        return float("nan"), float("nan"), float("nan"), 0
    diffs = [(a - b) / b * 100 if relative else a - b for a, b in zip(on[:pairs], off[:pairs])]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=pairs)) for _ in range(draws))
    return statistics.median(diffs), medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1], pairs


def paired_text(on: list[float], off: list[float], unit: str = "%", relative: bool = True) -> str:
    mid, low, high, pairs = paired(on, off, relative)
    return f"paired {mid:+.2f}{unit} (95% interval {low:+.2f} to {high:+.2f}{unit}, {pairs} pairs)"


def kernel_parts(times: tuple[int, ...]) -> dict[str, float]:
    """Microseconds per collective by part from ``NativeKernels.kernel_time()`` (or the difference of
    two readings): kernel, arguments, GIL, walk, record, leaving, write; empty when none was timed."""
    calls, ns, gil, walk, write, pre, post = times
    if calls <= 0:
        return {}
    per = calls * 1e3
    return {
        "kernel": ns / per,
        "arguments": pre / per,
        "GIL": gil / per,
        "walk": walk / per,
        "record": post / per,
        "leaving": (ns - pre - gil - walk - post - write) / per,
        "write": write / per,
    }


def kernel_split(native) -> str | None:
    """``native kernel: ... us per collective (arguments ..., ...)`` from the kernel's own clock,
    or None when the clock was off (``--kernel-clock``)."""
    times = native.kernel_time()
    part = kernel_parts(times)
    if not part:
        return None
    return (
        f"native kernel: {times[0]} collectives recorded, {part['kernel']:.2f} us each inside the kernel (arguments "
        f"{part['arguments']:.2f}, taking the GIL {part['GIL']:.2f}, stack walk {part['walk']:.2f}, "
        f"record {part['record']:.2f}, leaving {part['leaving']:.2f}, write {part['write']:.2f}), "
        f"fast walk {'on' if native.fast_walk else 'off'}, call-site cache {_site_cache(native)}, "
        f"formatting {'deferred to the writer' if getattr(native, 'defer_format', False) else 'on the recording thread'} "
        "(clock on: its reads add to these figures)"
    )


def _site_cache(native) -> str:
    """``on (N of M walks answered from it)`` or ``off``."""
    if not getattr(native, "site_cache", False):
        return "off"
    hits, misses = native.site_cache_counts()
    gil_free = (
        f", {native.gil_free_count()} recorded without taking the GIL"
        if getattr(native, "gil_free", False)
        else ", the GIL taken for every one"
    )
    return f"on ({hits} of {hits + misses} walks answered from it{gil_free})"
