"""Attribute a collective to code: call site, short stack, phase hints and the FSDP2 unit.

One walk up the Python stack per collective. Per-code-object facts (is it torch's or ours, is it
``Module.__call__``, an FSDP2 param-group method, a user checkpoint function) are computed once and
cached, so the walk is a loop of dict lookups.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass

import torch

import moedoctor

MAX_STACK = 8  # user frames kept per call site
MAX_WALK = 96  # frames looked at per collective

INTERNAL = 1
MODULE_CALL = 2
FSDP_GROUP = 4
CKPT_SAVE = 8
CKPT_LOAD = 16

_INTERNAL_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, moedoctor.__file__))
# The standard library counts as internal (contextlib, threading), installed packages do not:
# transformers or megatron frames are where users look for the cause.
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep})
_PACKAGE_DIRS = ("site-packages", "dist-packages")
_FSDP_GROUP_FILE = os.path.join("fsdp", "_fully_shard", "_fsdp_param_group.py")
_MODULE_CALL_NAMES = {"_call_impl", "_wrapped_call_impl"}
_CKPT_LOAD = re.compile(r"(load|restore).*(checkpoint|ckpt|state_dict)|(checkpoint|ckpt).*(load|restore)", re.I)
_CKPT_SAVE = re.compile(r"(save|write|persist).*(checkpoint|ckpt|state_dict)|(checkpoint|ckpt).*(save|write)", re.I)


@dataclass(slots=True)
class Attribution:
    site_key: tuple
    frames: list  # [(code, lineno)] of user frames, innermost first
    in_module_call: bool
    fsdp_module: str | None
    checkpoint: str | None  # "save" / "load" from user function names


_flags_cache: dict[object, int] = {}


def _flags(code) -> int:
    flags = _flags_cache.get(code)
    if flags is None:
        filename = code.co_filename
        flags = 0
        if (filename.startswith(_INTERNAL_DIRS) or filename.startswith("<")
                or (filename.startswith(_STDLIB_DIRS) and not any(d in filename for d in _PACKAGE_DIRS))):
            flags |= INTERNAL
            if code.co_name in _MODULE_CALL_NAMES and filename.endswith(os.path.join("nn", "modules", "module.py")):
                flags |= MODULE_CALL
            if filename.endswith(_FSDP_GROUP_FILE):
                flags |= FSDP_GROUP
        else:
            if _CKPT_LOAD.search(code.co_name):
                flags |= CKPT_LOAD
            elif _CKPT_SAVE.search(code.co_name):
                flags |= CKPT_SAVE
        _flags_cache[code] = flags
    return flags


def attribute(depth: int = 2) -> Attribution:
    """Walk the caller's stack (skipping ``depth`` frames of moedoctor's own)."""
    frame = sys._getframe(depth)
    frames: list = []
    in_module_call = False
    fsdp_module = None
    checkpoint = None
    walked = 0
    while frame is not None and walked < MAX_WALK:
        code = frame.f_code
        flags = _flags(code)
        if flags & INTERNAL:
            if flags & MODULE_CALL:
                in_module_call = True
            elif flags & FSDP_GROUP and fsdp_module is None:
                owner = frame.f_locals.get("self")
                fsdp_module = getattr(owner, "_module_fqn", None)
        else:
            if len(frames) < MAX_STACK:
                frames.append((code, frame.f_lineno))
            if flags & (CKPT_SAVE | CKPT_LOAD) and checkpoint is None:
                checkpoint = "load" if flags & CKPT_LOAD else "save"
        frame = frame.f_back
        walked += 1
    return Attribution(tuple(frames), frames, in_module_call, fsdp_module, checkpoint)


def describe(frames: list) -> tuple[str, int, str, list[str]]:
    """``(file, line, function, stack)`` for the frames of an attribution (cold path: once per site)."""
    code, line = frames[0]
    stack = [f"{c.co_filename}:{ln} {c.co_name}" for c, ln in frames]
    return code.co_filename, line, code.co_name, stack
