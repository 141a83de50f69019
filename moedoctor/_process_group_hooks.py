"""One wrapper around ``torch.distributed``'s ``init_process_group`` and ``destroy_process_group``
for everything moedoctor installs in a worker (the recorder, the fixes), instead of one wrapper each.

``after_init(callback)``: called after the default process group is created, in registration order,
however the job creates it: ``dist.init_process_group``, the function imported by name, or
``init_device_mesh`` (which holds its own reference, taken while torch was imported).
``before_destroy(callback)``: called before the default group is destroyed (destroying a subgroup
calls nothing), the last registered first: what was installed last is torn down first, so the
recorder (installed first) still records what the fixes do at the end.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

_after_init: list[Callable[[], None]] = []
_before_destroy: list[Callable[[], None]] = []
_installed = False


def after_init(callback: Callable[[], None]) -> None:
    _install()
    _after_init.append(callback)


def before_destroy(callback: Callable[[], None]) -> None:
    _install()
    _before_destroy.insert(0, callback)


def _install() -> None:
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original_init, original_destroy = c10d.init_process_group, c10d.destroy_process_group

    @functools.wraps(original_init)
    def init_process_group(*args, **kwargs):
        result = original_init(*args, **kwargs)
        for callback in list(_after_init):
            callback()
        return result

    @functools.wraps(original_destroy)
    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            for callback in list(_before_destroy):
                callback()
        return original_destroy(group)

    for module in (dist, c10d):
        module.init_process_group = init_process_group  # type: ignore[attr-defined]
        module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    # Modules that imported the functions by name before this ran hold the originals:
    # torch.distributed.device_mesh (init_device_mesh calls init_process_group through its own
    # reference), and any module imported while torch itself was.
    replacements = {id(original_init): init_process_group, id(original_destroy): destroy_process_group}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if module is None or module in (dist, c10d) or not isinstance(namespace, dict):
            continue
        for name in ("init_process_group", "destroy_process_group"):
            held = namespace.get(name)
            if held is not None and id(held) in replacements:
                namespace[name] = replacements[id(held)]
    _installed = True
