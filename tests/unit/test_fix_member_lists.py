"""expert-zero-term's structural mode: idle members of a module list run, in index order, on empty
inputs, with the owner's output bitwise unchanged and every member's parameters in the graph."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from moedoctor.fixes._member_lists import MemberLists  # noqa: E402


class Block(nn.Module):
    def __init__(self, loop_order=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.loop_order = loop_order

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e in self.loop_order or range(len(self.experts)):
            rows = route == e
            if not rows.any():
                continue  # the sparse loop: an expert without tokens is not called
            out[rows] = out[rows] + self.experts[e](x[rows])
        return x + out


class Runtime:
    checks_enabled = True

    def __init__(self) -> None:
        self.checks: list[tuple[str, bool | None, str]] = []

    def check(self, name, passed, detail="", worst=None):
        self.checks.append((name, passed, detail))

    def note(self, message):
        self.checks.append(("note", None, message))

    def write(self):
        pass


@pytest.fixture
def installed():
    from torch.nn.modules import module as torch_module

    before_pre = dict(torch_module._global_forward_pre_hooks)
    before_post = dict(torch_module._global_forward_hooks)
    runtime = Runtime()
    lists = MemberLists(runtime, types.SimpleNamespace(calls=0, patched=False))
    lists.install()
    yield runtime, lists
    torch_module._global_forward_pre_hooks.clear()
    torch_module._global_forward_pre_hooks.update(before_pre)
    torch_module._global_forward_hooks.clear()
    torch_module._global_forward_hooks.update(before_post)


def test_idle_members_run_in_order_and_get_zero_gradients(installed):
    runtime, lists = installed
    block = Block()
    x = torch.randn(6, 4, requires_grad=True)
    route = torch.tensor([0, 3, 3, 0, 0, 3])  # experts 1 and 2 idle
    calls = []
    for i, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(lambda m, a, i=i: calls.append((i, a[0].shape[0])))
    out = block(x, route)
    with torch.no_grad():  # the sparse result without any hook: .forward() bypasses module hooks
        plain = torch.zeros_like(x)
        for e in (0, 3):
            rows = route == e
            plain[rows] = plain[rows] + block.experts[e].forward(x[rows])
        plain = x + plain
    assert calls == [(0, 3), (1, 0), (2, 0), (3, 3)]  # one order on every rank: 0, 1, 2, 3
    assert torch.equal(out.view(torch.int32), plain.view(torch.int32))  # bitwise the sparse output
    out.sum().backward()
    grads = [e.weight.grad for e in block.experts]
    assert all(g is not None for g in grads)
    assert torch.count_nonzero(grads[1]) == 0 and torch.count_nonzero(grads[2]) == 0
    assert lists.filled == 2
    assert runtime.checks[-1][1] is True and "in index order" in runtime.checks[-1][0]


def test_a_loop_out_of_index_order_fails_the_check(installed):
    runtime, _ = installed
    block = Block(loop_order=[3, 0, 1, 2])
    block(torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1]))
    assert any(name.startswith("members run once") and passed is False and "out of index order" in detail
               for name, passed, detail in runtime.checks)


def test_the_check_fails_when_the_fix_runs_an_idle_member_twice(installed, monkeypatch):
    """The fix broken (each idle member filled in twice): the check, every member once per forward,
    must fail."""
    runtime, lists = installed
    fill = type(lists)._fill

    def twice(self, call, name, index, template):
        fill(self, call, name, index, template)
        fill(self, call, name, index, template)

    monkeypatch.setattr(type(lists), "_fill", twice)
    Block()(torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1]))
    assert any(name.startswith("members run once") and passed is False and "ran twice" in detail
               for name, passed, detail in runtime.checks), runtime.checks
