"""Turn recorded traces into the answer an on-call engineer needs: which ranks diverged, on which
collective of which group, from which line, which known deadlock it is, what to do, and the command
that proves the fix.

``load_run(path) -> RunData`` reads a run directory, a folder of traces or Flight Recorder dumps;
``analyze(run) -> Report`` returns typed findings; ``moedoctor.render`` turns them into a terminal
page, JSON, HTML or a Perfetto trace. Nothing here imports torch, prints, or exits.
"""

from moedoctor.analysis.diagnosis import analyze
from moedoctor.analysis.loading.run_data import RunData
from moedoctor.analysis.loading.load import load_run, load_runs
from moedoctor.analysis.model import Report, Verdict

__all__ = ["RunData", "Report", "Verdict", "analyze", "load_run", "load_runs"]
