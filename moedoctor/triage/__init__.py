"""``moedoctor triage --pid PID``: examine a running, stuck job from outside and explain it,
never stopping it. ``triage(pid, out_dir) -> TriageResult``; the report is an ordinary ``Report``."""

from moedoctor.triage.core import RankProcess, TriageResult, find_ranks, triage

__all__ = ["RankProcess", "TriageResult", "find_ranks", "triage"]
