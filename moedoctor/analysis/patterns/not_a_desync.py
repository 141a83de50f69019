"""``not-a-desync``: every rank is inside the same collective and none completes it.

Mechanism: not a code bug. The ranks agree on the collective (same op, shapes, dtypes, sequence
number) but it never completes: a dead link, a wedged GPU or NIC, a frozen process (all of its
threads stopped), a transport misconfiguration.

Evidence: every traced member of a group sits in the same collective, not completed; the NVML
snapshot (ECC errors, retired or remapped pages, utilization, processes), ranks that did not
answer the watchdog's snapshot request (their Python threads do not run), ranks whose stack could
not be read.

Risk: a collective that is merely slow (a huge all-reduce on a slow network) looks the same until
the hang timeout; the NVML and responsiveness evidence is what points at the machine.

Fix: none in the code. Check the hardware and the network.
"""

from __future__ import annotations

from moedoctor.analysis.model import DivergenceKind, Suggestion
from moedoctor.analysis.patterns import Context, Finding, Pattern, names


def classify(ctx: Context) -> Finding | None:
    div = ctx.div
    if div is None or div.kind != DivergenceKind.STALLED or ctx.cycle:
        return None
    v = next(iter(div.per_rank.values()))
    evidence = [f"every rank of group {div.group.label()} ({names(div.per_rank)}) is inside the same {v.op} "
                f"#{div.seq} ({[list(s) for s in v.shapes]} {'/'.join(v.dtypes)}, {v.short_site}) "
                "and none completed it"]
    evidence.extend(hardware_evidence(ctx))
    return Finding(0.9, tuple(evidence), suggestion=Suggestion(None, None, _ADVICE))


def hardware_evidence(ctx: Context) -> list[str]:
    view = ctx.view
    found = []
    for snap in view.run.gpus:
        if not snap.available:
            found.append(f"no GPU state for host {snap.host}: {snap.reason}")
            continue
        bad = []
        for d in snap.devices:
            if d.ecc_uncorrected:
                bad.append(f"GPU {d.index}: {d.ecc_uncorrected} uncorrected ECC errors")
            if d.retired_pending:
                bad.append(f"GPU {d.index}: page retirement pending")
            if d.remapped_failure:
                bad.append(f"GPU {d.index}: row remapping failed")
            if d.utilization is not None and d.utilization >= 99:
                bad.append(f"GPU {d.index}: {d.utilization}% busy (a kernel spinning, e.g. NCCL waiting)")
        found.append(f"NVML on {snap.host}: "
                     + ("; ".join(bad) if bad else f"no GPU errors on {len(snap.devices)} GPU(s)"))
    if view.hang_declared:
        silent = [r for r in view.ranks if not any(c.reason == "snapshot" for c in view.traces[r].coverage)]
        if silent:
            found.append(f"{names(silent)} did not answer the watchdog's snapshot request (no coverage record): "
                         "the process's Python threads are not running (stopped, or stuck in a driver call)")
    for r, dump in sorted(view.run.stacks.items()):
        if dump.error:
            found.append(f"rank {r}'s stack could not be read: {dump.error.split('. ')[0]}")
    return found


_ADVICE = ("Not a code problem: check the hardware and the network. Look for Xid errors in dmesg, ECC and retired "
           "pages in nvidia-smi -q, transport errors with NCCL_DEBUG=INFO, and each rank's process state "
           "(ps -o stat: T is stopped, D is stuck in the kernel). Patching the training code would be wrong.")

PATTERN = Pattern(
    id="not-a-desync", title="Not a desync (hardware or network)", fixes=(), desync=False, classify=classify,
    advice=_ADVICE,
)
