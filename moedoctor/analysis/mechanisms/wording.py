"""Level 1's wording: a finding's site in short, and the change to make written at the call site
from the mechanism alone (the suggestion a report gives when no pattern refines the mechanism)."""

from __future__ import annotations

from moedoctor.analysis.mechanisms.vocabulary import Mechanism, MechanismFinding
from moedoctor.analysis.model import Suggestion
from moedoctor.wording import rank_names


def short_site(site: str | None) -> str:
    """``train.py:14`` for ``/job/train.py:14``; ``?`` when no site is known."""
    return site.rsplit("/", 1)[-1] if site else "?"


def suggestion(finding: MechanismFinding) -> Suggestion:
    """What to change, written at the call site from the mechanism alone."""
    site = finding.loop_site or next((finding.sites[r] for r in finding.ranks if r in finding.sites), None)
    site = site or next(iter(finding.sites.values()), None)
    fn = next((finding.functions[r] for r in finding.ranks if r in finding.functions), None)
    short = site.rsplit("/", 1)[-1] if site else "the call site"
    m, mine, theirs = finding.mechanism, rank_names(finding.ranks), rank_names(finding.others)
    if m == Mechanism.LOOP_TRIP_COUNT and finding.counts:
        ran = ", ".join(f"rank {r} ran {n}" for r, n in sorted(finding.counts.items()))
        text = f"make the loop's trip count agree across ranks: {ran} iterations of {short}"
    elif m == Mechanism.LOOP_TRIP_COUNT:
        text = (
            f"make the number of passes over the step's repeated part agree across ranks: {mine} closed the step "
            f"while {theirs} began another pass ({short})"
        )
    elif m == Mechanism.EXTRA_COLLECTIVE:
        text = f"issue the collective at {short} on every rank of the group, or on none: only {mine} issued it"
    elif m == Mechanism.SKIPPED_COLLECTIVE:
        text = (
            f"make {mine} issue the collective the others issue at {short}, or take the decision to skip it "
            "collectively"
        )
    elif m in (Mechanism.DIFFERENT_SHAPE, Mechanism.DIFFERENT_DTYPE, Mechanism.DIFFERENT_REDUCE_OP):
        what = {Mechanism.DIFFERENT_SHAPE: "sizes", Mechanism.DIFFERENT_DTYPE: "dtypes"}.get(m, "reduce op")
        text = f"make the {what} of the collective at {short} agree across ranks"
    elif m == Mechanism.DIFFERENT_SPLITS:
        text = f"derive the receive sizes at {short} from what the peers send (exchange the counts first)"
    elif m == Mechanism.DIFFERENT_OP:
        text = f"make every rank issue the group's collectives in the same order at {short}"
    elif m == Mechanism.WAIT_CYCLE:
        text = f"issue the collectives of these groups in one fixed order on every rank (at {short})"
    elif m == Mechanism.UNMATCHED_P2P:
        text = f"pair every send at {short} with a recv of the same size on its peer"
    elif m == Mechanism.RANK_OUTSIDE:
        state = finding.state.value if finding.state else "state unknown"
        text = f"find why {mine} never reached the collective the others wait in at {short} ({state})"
    else:
        text = f"every rank is inside the collective at {short}: check the transport (network, GPU, NCCL settings)"
    return Suggestion(site, fn, text)
