"""What a job running under ``moedoctor run`` forwards to processes that do not inherit its
environment: the workers of a Ray cluster that already runs (``ray start``), which its raylet starts.

One line in the driver records them::

    from moedoctor.launchers import ray_runtime_env
    ray.init(address="auto", runtime_env=ray_runtime_env())

``ray_runtime_env()`` is Ray's ``runtime_env`` with ``env_vars``: the bootstrap on ``PYTHONPATH``, the
run directory and this launch's marker (so moedoctor finds the workers' traces, dumps their stacks and
stops them with the job), and the recorder's settings. Outside ``moedoctor run`` it is empty (``{}``),
so the line changes nothing. A ``runtime_env`` of the job's own is merged with ``ray_runtime_env(env)``.
Light: no torch, no ray imported here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moedoctor import environment


def moedoctor_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables ``moedoctor run`` set for this job (empty outside it)."""
    environ = os.environ if environ is None else environ
    if not environment.run_dir(environ):
        return {}
    env = environment.ours(environ)
    if environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = environ["PYTHONPATH"]
    return env


def ray_runtime_env(runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``runtime_env`` (or a new one) with moedoctor's variables added to its ``env_vars``; the job's
    own ``PYTHONPATH`` there, if any, stays after moedoctor's bootstrap."""
    out = dict(runtime_env or {})
    ours = moedoctor_env()
    if not ours:
        return out
    env_vars = dict(out.get("env_vars") or {})
    if env_vars.get("PYTHONPATH") and "PYTHONPATH" in ours:
        ours["PYTHONPATH"] = os.pathsep.join([ours["PYTHONPATH"], env_vars["PYTHONPATH"]])
    env_vars.update(ours)
    out["env_vars"] = env_vars
    return out
