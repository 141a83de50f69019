"""``moedoctor verify``'s library: rerun a job with fixes injected and prove them (``verify``)."""

from moedoctor.verification.plan import VerifyPlan, plan_verify
from moedoctor.verification.verify import Check, OriginalRun, Verification, VerifyConfig, load_original, verify

__all__ = [
    "Check",
    "OriginalRun",
    "Verification",
    "VerifyConfig",
    "VerifyPlan",
    "load_original",
    "plan_verify",
    "verify",
]
