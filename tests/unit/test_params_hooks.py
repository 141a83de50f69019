"""``--check-params`` hooks: nothing installed without the option; with it, fingerprints at the first
forward and after optimizer step N (one process, no process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
from torch.nn.modules import module as m
original = dist.broadcast
from moedoctor.recorder.install import activate_from_env
activate_from_env()
hooked = "moedoctor.recorder.params" in sys.modules
print("HOOKED" if hooked else "CLEAN",
      dist.broadcast is original, len(m._global_forward_pre_hooks), len(m._global_parameter_registration_hooks))
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
"""


def _run(tmp_path: Path, **env) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOEDOCTOR_")}
    full.update({"MOEDOCTOR_RUN_DIR": str(tmp_path), "MOEDOCTOR_NATIVE": "0", **env})
    root = Path(__file__).resolve().parents[2]
    full["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_nothing_is_installed_without_the_option(tmp_path):
    assert _run(tmp_path).split() == ["CLEAN", "True", "0", "0"]
    assert not (tmp_path / "params").exists()


def test_with_the_option_fingerprints_at_first_forward_and_after_step_n(tmp_path):
    first = _run(tmp_path, MOEDOCTOR_CHECK_PARAMS="2").split()
    assert first[:2] == ["HOOKED", "False"]
    lines = [json.loads(x) for x in (tmp_path / "params" / "rank-0.jsonl").read_text().splitlines()]
    assert [(x["point"], x["step"]) for x in lines] == [("prepared", 0), ("step", 2)]
    prepared = {t[0]: t for t in lines[0]["tensors"]}
    assert sorted(prepared) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert prepared["1.weight"][4][3:] == [1.0, 1.0]  # LayerNorm weight: min == max, a constant tensor
    stepped = {t[0] for t in lines[1]["tensors"]}
    assert {"0.weight#exp_avg", "0.weight#exp_avg_sq"} <= stepped


def test_fingerprint_is_chunk_independent_and_tells_a_permutation(monkeypatch):
    import torch

    from moedoctor.recorder import params

    x = torch.randn(50_000)
    whole = params.fingerprint(x)
    monkeypatch.setattr(params, "_CHUNK", 8192)
    chunked = params.fingerprint(x)
    assert torch.allclose(whole, chunked, rtol=1e-12, atol=1e-9)
    shuffled = params.fingerprint(x[torch.randperm(x.numel())])
    assert torch.allclose(whole[[0, 1, 3, 4]], shuffled[[0, 1, 3, 4]]) and not torch.isclose(whole[2], shuffled[2])
    ones = params.fingerprint(torch.ones(3, 4, dtype=torch.bfloat16))
    assert ones[3] == ones[4] == 1.0


def test_a_parameter_replaced_in_place_of_the_registered_one_is_still_found(tmp_path):
    """Empty-weights loaders assign into ``module._parameters`` (no registration hook): the print
    taken before a broadcast must still find the module's current parameter."""
    import torch

    from moedoctor.recorder.params import _ParamCheck

    check = _ParamCheck(tmp_path, 1)
    layer = torch.nn.Linear(4, 4)
    for name, p in layer.named_parameters():
        check.on_register(layer, name, p)
    check.before_broadcast([layer.weight], 0, [0, 1])  # indexes the registered parameters
    layer._parameters["bias"] = torch.nn.Parameter(torch.empty_like(layer.bias))
    check.before_broadcast([layer.bias], 0, [0, 1])
    assert sorted(check.registered[i][1] for i in check.before) == ["bias", "weight"]
