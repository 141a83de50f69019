"""How often triage's culprit from stacks and source (``moedoctor/triage/loop_exit.py``) agrees with the
culprit the traces give, on run directories that hold both (``moedoctor run`` of the variants corpus:
``stacks/`` and ``report.json``).

For each run directory whose stacks alone give ``unknown-desync`` with no culprit (ranks in
different collectives, no majority), the ranks past a loop the others wait inside are named, or
not; a named culprit is compared with the report's (from the traces). Prints one line per such run
and the counts. The job's source files must still be where the stacks say they ran.

    python benchmarks/stack_culprit_accuracy.py RUNS_FOLDER [RUNS_FOLDER ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from moedoctor.analysis.from_stacks import report_from_stacks
from moedoctor.analysis.loading.load import load_run
from moedoctor.errors import MoedoctorError
from moedoctor.triage.loop_exit import name_culprit


def main(folders: list[str]) -> None:
    counts: Counter[str] = Counter()
    for folder in folders:
        for d in sorted(Path(folder).iterdir()):
            if not (d / "stacks").is_dir() or not (d / "report.json").is_file():
                continue
            try:
                truth = json.loads((d / "report.json").read_text())
                run = load_run(d)
            except (OSError, ValueError, MoedoctorError):
                counts["unreadable"] += 1
                continue
            rep = report_from_stacks(run.stacks, source=str(d), world_size=run.world_size)
            if rep.pattern != "unknown-desync" or rep.culprit_ranks:
                counts["other stacks verdict"] += 1
                continue
            rep = name_culprit(rep, run.stacks)
            if not rep.culprit_ranks:
                counts["not named"] += 1
                print(f"not named  {d.name}  (traces: {truth.get('culprit_ranks')})")
                continue
            agree = rep.culprit_ranks == truth.get("culprit_ranks")
            counts["agrees" if agree else "DISAGREES"] += 1
            print(
                f"{'agrees' if agree else 'DISAGREES'}  {d.name}  named {rep.culprit_ranks}, traces "
                f"{truth.get('culprit_ranks')} ({truth.get('pattern')})"
            )
    print(dict(counts))


if __name__ == "__main__":
    main(sys.argv[1:])
