"""The fix modules moedoctor can inject into a job, one file each, in a registry.

A fix runs only when named (``moedoctor verify --fix NAME``, ``moedoctor run --fix NAME``): the
bootstrap installs it in every worker, next to the recorder. ``docs/fixes.md`` explains each one.
"""

from __future__ import annotations

from moedoctor.errors import MoedoctorError
from moedoctor.fixes import (
    coalesce_broadcasts,
    expert_dense,
    expert_zero_term,
    fsdp_gather_upfront,
    key_manifest_checkpoint,
    metrics_after_microbatches,
    recompute_cache_collective,
    skip_step_collectively,
)
from moedoctor.fixes.base import Fix, FixConfigError, Target

FIXES: dict[str, Fix] = {
    module.FIX.name: module.FIX
    for module in (
        expert_dense,
        expert_zero_term,
        skip_step_collectively,
        metrics_after_microbatches,
        fsdp_gather_upfront,
        key_manifest_checkpoint,
        coalesce_broadcasts,
        recompute_cache_collective,
    )
}


def get_fix(name: str) -> Fix:
    """The fix called ``name``; a ``MoedoctorError`` listing the known ones otherwise."""
    try:
        return FIXES[name]
    except KeyError:
        raise MoedoctorError(
            f"no fix called {name!r}; known fixes: {', '.join(FIXES)} (moedoctor fixes lists them)"
        ) from None


def fixes_for_pattern(pattern: str) -> list[Fix]:
    return [fix for fix in FIXES.values() if pattern in fix.patterns]


__all__ = ["FIXES", "Fix", "FixConfigError", "Target", "fixes_for_pattern", "get_fix"]
