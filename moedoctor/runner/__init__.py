"""``moedoctor run``'s library: launch a torchrun job with the recorder injected, follow its
traces, detect a hang, collect stacks and GPU state, stop the job, write the manifest.

Nothing here prints or exits; ``moedoctor.cli.run`` renders what ``run_job`` reports.
"""

from moedoctor.runner.launch import Outcome, RunConfig, RunObserver, RunResult, RunStatus, run_job
from moedoctor.runner.rundir import RunDir, default_run_dir, prepare_run_dir

__all__ = [
    "Outcome",
    "RunConfig",
    "RunDir",
    "RunObserver",
    "RunResult",
    "RunStatus",
    "default_run_dir",
    "prepare_run_dir",
    "run_job",
]
