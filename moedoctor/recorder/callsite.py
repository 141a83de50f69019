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
from typing import NamedTuple

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
# Installed modules that only wrap what torch hands out: torch 2.x decorates c10d functions
# (``reduce_scatter_tensor``, ``all_gather_into_tensor``) with ``typing_extensions.deprecated``, whose
# wrapper frame would otherwise be every such collective's call site.
_WRAPPER_FILES = (os.sep + "typing_extensions.py",)
_FSDP_GROUP_FILE = os.path.join("fsdp", "_fully_shard", "_fsdp_param_group.py")
_MODULE_CALL_NAMES = {"_call_impl", "_wrapped_call_impl"}
_CKPT_LOAD = re.compile(r"(load|restore).*(checkpoint|ckpt|state_dict)|(checkpoint|ckpt).*(load|restore)", re.I)
_CKPT_SAVE = re.compile(r"(save|write|persist).*(checkpoint|ckpt|state_dict)|(checkpoint|ckpt).*(save|write)", re.I)


class Attribution(NamedTuple):
    site_key: tuple  # (code, lineno, code, lineno, ...) of user frames, innermost first
    flags: int  # the union of every walked frame's flags (MODULE_CALL, CKPT_SAVE, CKPT_LOAD, ...)
    fsdp_module: str | None


_flags_cache: dict[object, int] = {}


def _flags(code) -> int:
    flags = _flags_cache.get(code)
    if flags is None:
        filename = code.co_filename
        flags = 0
        if (
            filename.startswith(_INTERNAL_DIRS)
            or filename.startswith("<")
            or filename.endswith(_WRAPPER_FILES)
            or (filename.startswith(_STDLIB_DIRS) and not any(d in filename for d in _PACKAGE_DIRS))
        ):
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
    """Walk the caller's stack (skipping ``depth`` frames of moedoctor's own). On the hot path of
    every collective: a loop of cached dict lookups, no allocation but the result."""
    frame = sys._getframe(depth)
    cached = _flags_cache.get
    site: list = []
    union = 0
    fsdp_module = None
    walked = 0
    while frame is not None and walked < MAX_WALK:
        code = frame.f_code
        flags = cached(code)
        if flags is None:
            flags = _flags(code)
        if not flags & INTERNAL:
            if len(site) < 2 * MAX_STACK:
                site.append(code)
                site.append(frame.f_lineno)
        elif flags & FSDP_GROUP and fsdp_module is None:
            fsdp_module = getattr(frame.f_locals.get("self"), "_module_fqn", None)
        union |= flags
        frame = frame.f_back
        walked += 1
    return Attribution(tuple(site), union, fsdp_module)


def describe(site_key: tuple) -> tuple[str, int, str, list[str]]:
    """``(file, line, function, stack)`` of an attribution's site (cold path: once per site)."""
    pairs = list(zip(site_key[::2], site_key[1::2]))
    code, line = pairs[0]
    stack = [f"{c.co_filename}:{ln} {c.co_name}" for c, ln in pairs]
    return code.co_filename, line, code.co_name, stack


def first_frame(site_key: tuple) -> str | None:
    """``file:line`` of the innermost user frame, or None."""
    return f"{site_key[0].co_filename}:{site_key[1]}" if site_key else None
