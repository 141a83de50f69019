"""``params_without_grad`` evidence (``recorder/evidence.py``): written when the set of parameters
without a gradient changes, and named only then (naming costs about 4 us a parameter, and an MoE
model can hold thousands of idle experts' parameters at every backward and step)."""

from __future__ import annotations

import types

import pytest
import torch

from moedoctor.recorder import evidence


def _recorder():
    rec = types.SimpleNamespace(records=[], step=1, paused=False)
    rec.write_evidence = lambda kind, data: rec.records.append((kind, data))
    return rec


def test_the_set_is_named_and_written_only_when_it_changes(monkeypatch):
    rec = _recorder()
    gradients = evidence._Gradients(rec)
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(6)]
    for p in params[::2]:
        p.grad = torch.zeros(3)
    optimizer = torch.optim.SGD(params, lr=0.1)
    named = []
    real = evidence._named
    monkeypatch.setattr(evidence, "_named", lambda optimizer, missing: named.append(len(missing)) or real(optimizer, missing))

    gradients.note(optimizer)
    gradients.note(optimizer)  # the same three parameters lack a gradient: nothing to name or write
    assert named == [3]
    assert [(kind, data["count"], data["shapes"]) for kind, data in rec.records] == [
        ("params_without_grad", 3, [[3], [3], [3]])
    ]
    # No module holds them: named by their place in the optimizer.
    assert rec.records[0][1]["names"] == ["param_groups[0][1]", "param_groups[0][3]", "param_groups[0][5]"]
    params[1].grad = torch.zeros(3)
    gradients.note(optimizer)
    assert named == [3, 2] and rec.records[-1][1]["count"] == 2
    for p in params:
        p.grad = torch.zeros(3)
    gradients.note(optimizer)
    assert named == [3, 2, 0] and rec.records[-1][1] == {"names": [], "shapes": [], "count": 0}


@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_parameter_is_not_missing_its_gradient(frozen):
    rec = _recorder()
    p = torch.nn.Parameter(torch.zeros(2), requires_grad=not frozen)
    evidence._Gradients(rec).note(torch.optim.SGD([p], lr=0.1))
    assert [data["count"] for _, data in rec.records] == ([] if frozen else [1])


def test_a_backward_that_raised_is_marked_and_its_gradients_are_not_checked(monkeypatch):
    """Autograd stopped part-way (a recompute's CheckpointError): the parameters it had not reached
    have no gradient whatever the routing, so the set is not written; the end record says it raised."""
    monkeypatch.setattr(torch.autograd, "backward", torch.autograd.backward)  # restored after the test
    rec = _recorder()
    rec.write_evidence = lambda kind, data=None, step=None: rec.records.append((kind, data))
    gradients = evidence._Gradients(rec)
    checked = []
    monkeypatch.setattr(gradients, "after_backward", lambda: checked.append(True))
    evidence._install_backward_hook(rec, gradients)
    w = torch.nn.Parameter(torch.ones(2))

    def fails(ctx_grad):
        raise RuntimeError("stopped part-way")

    bad = (w * 2).sum()
    bad.register_hook(fails)
    with pytest.raises(RuntimeError, match="stopped part-way"):
        bad.backward()
    assert ("backward_end", {"raised": "RuntimeError"}) in rec.records and checked == []
    (w * 2).sum().backward()
    assert rec.records[-1] == ("backward_end", None) and checked == [True]
