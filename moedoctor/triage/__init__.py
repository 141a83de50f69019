"""``moedoctor triage --pid PID``: examine a running, stuck job from outside and explain it,
never stopping it. ``triage(pid, out_dir) -> TriageResult``; the report is an ordinary ``Report``.
``merge_triages(dirs)``: one report from the triage folders of a multi-node job's nodes."""

from moedoctor.triage.core import RankProcess, TriageResult, find_ranks, merge_triages, triage

__all__ = ["RankProcess", "TriageResult", "find_ranks", "merge_triages", "triage"]
