"""``moedoctor verify``'s library: rerun a job with fixes injected and prove them (``verify``)."""

from moedoctor.verification.verify import Check, OriginalRun, Verification, VerifyConfig, load_original, verify

__all__ = ["Check", "OriginalRun", "Verification", "VerifyConfig", "load_original", "verify"]
