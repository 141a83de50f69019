"""Every member of a module list runs once per forward of its owner, in index order.

``expert-zero-term``'s structural mode (``lists: auto``), for MoE blocks moedoctor has no class for.
A module that owns an ``nn.ModuleList`` of two or more members of one class, each with parameters
(the experts of a sparse MoE block; decoder layers too, which run anyway), is watched through
torch's global module hooks, so no class is named and no ``forward`` replaced (a job that patches its
block's ``forward`` after import keeps its patch):

* while the owner's forward runs, a member about to run first calls each lower-numbered member that
  has not run in this forward on an empty input (its own inputs sliced to zero rows);
* when the owner's forward returns, the members that never ran are called the same way;
* ``sum() * -0.0`` of those empty outputs is added to the owner's output (bitwise unchanged).

So every member runs exactly once per owner forward, in index order, on every rank: an FSDP2 unit
per member is all-gathered in the same order everywhere, and every member's parameters are in the
autograd graph (zero gradients), so reduce-scatters and DDP buckets match. The check that the job's
own loop allows this: per owner forward, each member ran once and in index order; a loop that calls
members twice or in another order fails it (the fix cannot keep one order there).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from moedoctor.fixes._moe_blocks import first_tensor, with_first_tensor

CHECK = "members run once per forward, in index order"
TARGET = "module lists (by structure; every nn.ModuleList of 2+ same-class members with parameters)"


class _Call:
    """One running forward of an owner: per list, who ran, what to call idle members with."""

    def __init__(self, owner: Any, lists: list[tuple[str, Any]]) -> None:
        self.owner = owner
        self.lists: dict[str, dict[str, Any]] = {
            name: {"ran": [0] * len(members), "next": 0, "template": None, "out_of_order": False}
            for name, members in lists
        }
        self.pending: Any = None  # the zero terms of fills not yet joined to the graph
        self.filled = 0
        self.filling = False


class MemberLists:
    def __init__(self, runtime, state) -> None:
        self.runtime = runtime
        self.state = state  # the runtime's TargetState for TARGET
        self.owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> [(name, list)]
        self.members: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # member -> (owner ref, name, i)
        self.inspected: weakref.WeakSet = weakref.WeakSet()
        self.templates: dict[tuple[int, str], tuple] = {}
        self.local = threading.local()
        self.forwards = 0
        self.filled = 0

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        register_module_forward_pre_hook(self._pre)  # type: ignore[arg-type]  # it may return new args
        register_module_forward_hook(self._post)

    # -- discovery ------------------------------------------------------------------------------------

    def _inspect(self, module: Any) -> None:
        import torch.nn as nn

        self.inspected.add(module)
        lists = []
        for name, child in module.named_children():
            if not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                continue
            members = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
            if (
                len(members) >= 2
                and len({type(m) for m in members}) == 1
                and all(next(m.parameters(), None) is not None for m in members)
            ):
                lists.append((name, members))
                for index, member in enumerate(members):
                    self.members[member] = (weakref.ref(module), name, index)
        if lists:
            self.owners[module] = lists

    # -- hooks ----------------------------------------------------------------------------------------

    def _stack(self) -> list[_Call]:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _pre(self, module: Any, args: tuple) -> tuple | None:
        if module not in self.inspected:
            self._inspect(module)
        stack = self._stack()
        changed = self._as_member(module, args, stack)
        if module in self.owners:
            stack.append(_Call(module, self.owners[module]))
        return changed

    def _as_member(self, module: Any, args: tuple, stack: list[_Call]) -> tuple | None:
        role = self.members.get(module)
        if role is None:
            return None
        owner = role[0]()
        call = next((c for c in reversed(stack) if c.owner is owner), None)
        if call is None or call.filling:
            return None  # called outside its owner's forward, or our own fill
        name, index = role[1], role[2]
        entry = call.lists[name]
        if entry["template"] is None:
            entry["template"] = _empty_like(args)
            self.templates[(id(owner), name)] = _kept(entry["template"])
        if index < entry["next"]:
            entry["out_of_order"] = True
        for j in range(entry["next"], index):
            if not entry["ran"][j]:
                self._fill(call, name, j, entry["template"])
        entry["ran"][index] += 1
        entry["next"] = max(entry["next"], index + 1)
        # The idle members' zero terms join this member's input, so that in backward they come right
        # after it, where they would have been had they run (the order FSDP2 reduces them in).
        return _joined(args, call)

    def _post(self, module: Any, args: tuple, output: Any) -> Any:
        stack = self._stack()
        if module not in self.owners or not stack or stack[-1].owner is not module:
            return None
        call = stack.pop()
        for name, members in self.owners[module]:
            entry = call.lists[name]
            template = entry["template"] or self.templates.get((id(module), name)) or _from_owner_input(args)
            for j in range(len(members)):
                if not entry["ran"][j]:
                    if template is None:
                        self.runtime.note(
                            f"{type(module).__name__}.{name}: no input to run idle member {j} with "
                            "(no tensor input seen)"
                        )
                        continue
                    self._fill(call, name, j, template)
            self._check(module, name, entry)
        self.forwards += 1
        self.state.calls = self.forwards
        self.state.patched = True
        if self.forwards == 1:
            self.runtime.write()
        if call.pending is None:
            return None
        return _with_zero_term(output, call.pending)

    def _fill(self, call: _Call, name: str, index: int, template: tuple) -> None:
        members = dict(self.owners[call.owner])[name]
        call.filling = True
        try:
            out = members[index](*template)
        finally:
            call.filling = False
        term = _zero_of(out)
        if term is not None:  # chained as they are made: backward then visits them in reverse order
            call.pending = term if call.pending is None else call.pending + term
        call.lists[name]["ran"][index] += 1
        self.filled += 1

    def _check(self, owner: Any, name: str, entry: dict) -> None:
        if not self.runtime.checks_enabled:
            return
        where = f"{type(owner).__name__}.{name}"
        twice = [i for i, n in enumerate(entry["ran"]) if n > 1]
        if entry["out_of_order"] or twice:
            why = "called out of index order" if entry["out_of_order"] else f"member(s) {twice} ran twice"
            self.runtime.check(
                CHECK,
                False,
                f"{where}: {why} in one forward: one order on every rank cannot be kept by filling in idle members",
            )
        elif self.forwards < 3 or self.forwards % 100 == 0:
            self.runtime.check(
                CHECK,
                True,
                f"{where} and the other lists: every member once, in index order, in "
                f"{self.forwards + 1} forward(s); {self.filled} idle member call(s) added "
                "on this rank",
            )


def _empty_like(args: tuple) -> tuple:
    """The call's arguments with every tensor cut to zero rows (the same dtype, device, other dims),
    still in the autograd graph: an idle member's input then needs a gradient, as a real one's does,
    which is what makes FSDP2 reduce it during backward rather than at its end."""
    import torch

    return tuple(a[:0] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in args)


def _kept(args: tuple) -> tuple:
    """A template kept for later forwards: out of this forward's graph, needing a gradient as before."""
    import torch

    return tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)


def _from_owner_input(args: tuple) -> tuple | None:
    import torch

    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    return None if first is None else (first.reshape(-1, first.shape[-1])[:0],)


def _zero_of(out: Any) -> Any:
    """``-0.0 * out.sum()`` (the first tensor of a tuple output): zero, with out's graph behind it."""
    import torch

    tensor = (
        out
        if isinstance(out, torch.Tensor)
        else next((t for t in out if isinstance(t, torch.Tensor)), None)
        if isinstance(out, (tuple, list))
        else None
    )
    return None if tensor is None else tensor.sum().float() * -0.0


def _joined(args: tuple, call: _Call) -> tuple | None:
    """``args`` with the pending zero terms added to the first floating tensor (bitwise the same)."""
    import torch

    if call.pending is None:
        return None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            joined = a + call.pending.to(a.dtype)
            call.pending = None
            return (*args[:i], joined, *args[i + 1 :])
    return None  # no floating input: the terms wait for the owner's output


def _with_zero_term(output: Any, zero: Any) -> Any:
    import torch

    hidden = first_tensor(output) if not isinstance(output, (tuple, list)) or output else None
    if not isinstance(hidden, torch.Tensor):
        return None  # an output we cannot add to: the idle members ran (gathered), without a gradient path
    return with_first_tensor(output, hidden + zero.to(hidden.dtype))
