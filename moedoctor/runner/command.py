"""The command ``moedoctor run`` wraps. Any command works: its process is the job's root, and every
Python process started under it that creates a default process group is a rank (``runner/ranks.py``).
torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``) is recognized as such: its
workers carry ``RANK`` from the start (a rank stuck before ``init_process_group`` is still found),
its failure report gives the ranks' exit statuses, and its multi-node options drive the exchange.
``moedoctor verify`` still wraps torchrun only (``check_torchrun``)."""

from __future__ import annotations

import os
import re

from moedoctor.errors import EXIT_USAGE, MoedoctorError

_PYTHON = re.compile(r"python(\d+(\.\d+)*)?$")
_LAUNCH_MODULE = "torch.distributed.run"
#: Options that legitimately differ between the nodes of one multi-node run.
_PER_NODE_OPTIONS = ("--node_rank", "--node-rank")


def check_launcher(command: list[str]) -> list[str]:
    """Return ``command`` unchanged (any command: torchrun, ``python train.py``, ``accelerate launch``,
    a Ray driver...); raise ``MoedoctorError`` when there is none."""
    if not command:
        raise MoedoctorError(
            "no command to run: give it after '--', e.g. moedoctor run -- torchrun --nproc_per_node=2 train.py "
            "(or any command: python train.py, accelerate launch ..., a Ray driver)",
            EXIT_USAGE,
        )
    return command


#: Launchers whose first ``.py`` argument is the script every rank runs.
_SCRIPT_LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "lightning")


def missing_script(command: list[str], cwd: str | None = None) -> str | None:
    """The Python script ``command`` would run when it does not exist (``"train.py: no such file"``),
    else None. The script is the first argument ending in ``.py`` (``torchrun ... train.py``, ``python
    train.py``, ``accelerate launch train.py``); a module (``-m``) or a command without one is not checked."""
    program = os.path.basename(command[0]) if command else ""
    if program not in _SCRIPT_LAUNCHERS and _PYTHON.match(program) is None:
        return None  # another program's arguments are its own business
    for arg in command[1:]:
        if arg.startswith("-") or not arg.endswith(".py"):
            continue
        path = arg if os.path.isabs(arg) or cwd is None else os.path.join(cwd, arg)
        return None if os.path.exists(path) else f"{arg}: no such file"
    return None


def is_torchrun(command: list[str]) -> bool:
    """Whether ``command`` starts a torchrun launcher (``torchrun`` or ``python -m torch.distributed.run``)."""
    if not command:
        return False
    program = os.path.basename(command[0])
    return program == "torchrun" or (_PYTHON.match(program) is not None and _module_of(command[1:]) == _LAUNCH_MODULE)


def check_torchrun(command: list[str]) -> list[str]:
    """Return ``command`` unchanged if it starts a torchrun launcher; raise ``MoedoctorError``."""
    check_launcher(command)
    if is_torchrun(command):
        return command
    raise MoedoctorError(
        f"moedoctor verify wraps a torchrun launcher, not {' '.join(command[:3])!r}: use "
        "'torchrun [torchrun args] SCRIPT [args]' or 'python -m torch.distributed.run ...'",
        EXIT_USAGE,
    )


def _module_of(args: list[str]) -> str | None:
    """The module a python command line runs with ``-m``, skipping interpreter flags before it."""
    for i, arg in enumerate(args):
        if arg == "-m":
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if not arg.startswith("-"):
            return None
    return None


def node_rank(command: list[str]) -> str:
    """The command's ``--node_rank`` (``--node-rank``) value as written; ``"0"`` when absent."""
    for i, arg in enumerate(command):
        if arg in _PER_NODE_OPTIONS and i + 1 < len(command):
            return command[i + 1]
        for option in _PER_NODE_OPTIONS:
            if arg.startswith(option + "="):
                return arg[len(option) + 1 :]
    return "0"


def same_job(a: list[str], b: list[str]) -> bool:
    """Whether two nodes run the same job: equal commands except for the node rank option."""
    return _without_node_rank(a) == _without_node_rank(b)


def _without_node_rank(command: list[str]) -> list[str]:
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg in _PER_NODE_OPTIONS:
            skip = True
            continue
        if arg.startswith(tuple(o + "=" for o in _PER_NODE_OPTIONS)):
            continue
        out.append(arg)
    return out
