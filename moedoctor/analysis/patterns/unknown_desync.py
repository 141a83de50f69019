"""``unknown-desync``: the ranks diverged, and no known pattern explains it.

Mechanism: any collective desync; this pattern is the fallback the analysis names when no other
pattern reaches the threshold or the best two tie (then every candidate is listed with its
evidence).

Evidence: a divergence (mismatch, missing ranks or an unmatched p2p op) and nothing more specific.

Risk: none in naming it; the divergence, culprits and call sites are still reported.

Fix: none to name; read the side-by-side table around the divergence.
"""

from __future__ import annotations

from moedoctor.analysis.model import Suggestion
from moedoctor.analysis.patterns import Context, Finding, Pattern, names


def classify(ctx: Context) -> Finding | None:
    if not ctx.desync_kind():
        return None
    div = ctx.div
    per = "; ".join(f"rank {r}: " + ("nothing" if v is None else v.describe())
                    for r, v in list(div.per_rank.items())[:6])
    culprit = next((v for r, v in div.per_rank.items() if r in ctx.culprits.ranks and v is not None), None)
    culprit = culprit or next((v for v in div.per_rank.values() if v is not None), None)
    evidence = [f"group {div.group.label()} diverges at #{div.seq}: {per}"]
    silent = [r for r in div.missing if ctx.view.stack(r) is None and not ctx.view.died(r)]
    if silent:
        evidence.append(f"without a stack of {names(silent)} it cannot be told whether "
                        f"{'it is' if len(silent) == 1 else 'they are'} stuck in other code (a straggler) or skipped "
                        "the collective (a desync)")
    return Finding(0.2, tuple(evidence),
                   suggestion=Suggestion(culprit.call_site if culprit else None,
                                         culprit.function if culprit else None, _ADVICE))


_ADVICE = ("Make this collective unconditional and identical on every rank of the group: compare the call sites "
           "in the table above and find the rank-dependent branch, loop count or size between them.")

PATTERN = Pattern(
    id="unknown-desync", title="Unknown desync", fixes=(), desync=True, classify=classify, advice=_ADVICE,
)
