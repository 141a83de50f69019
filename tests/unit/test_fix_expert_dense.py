"""``expert-dense`` and ``expert-zero-term`` in one process, no process group: the patched forwards
give the sparse output and gradients (every transformers 5 class listed as a target included), the
checks, the refusals, and the ``blocks:`` config.

Installing a fix patches classes for the whole process: ``install`` below restores every class it
may touch and only patches modules that are already imported (no import hooks left behind).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from moedoctor.fixes import expert_dense, expert_zero_term
from moedoctor.fixes import runtime as fix_runtime
from moedoctor.fixes._moe_blocks import TRANSFORMERS5_FUSED_EXPERTS
from moedoctor.fixes.base import FixConfigError
from moedoctor.fixes.runtime import FixRuntime

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
sys.path.insert(0, str(FIXTURES))

from _lib.moe import TinyMoeConfig, TinyMoeMLP, TinyMoeModel, TinyMoeSparseMoeBlock, blocked_experts  # noqa: E402

try:
    import transformers
except ImportError:  # the fixture-block tests still run
    transformers = None
TRANSFORMERS5 = transformers is not None and int(transformers.__version__.split(".")[0]) >= 5
needs_transformers5 = pytest.mark.skipif(not TRANSFORMERS5, reason="fused experts are transformers 5.x")
FIXTURE_TARGET = "_lib.moe:TinyMoeSparseMoeBlock.forward"


@pytest.fixture
def install(monkeypatch):
    """``install(fix, config)`` -> its FixRuntime (checks on); every patched class restored afterwards."""

    def already_imported(name, callback):
        if name in sys.modules:
            callback(sys.modules[name])

    monkeypatch.setattr(fix_runtime, "when_imported", already_imported)

    def do_install(module, config=None):
        fix = module.FIX
        config = fix.parse_config(config or {})
        for target in fix.all_targets(config):
            owner = sys.modules.get(target.module)
            *parents, attr = target.qualname.split(".")
            for part in parents:
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, attr):
                monkeypatch.setattr(owner, attr, getattr(owner, attr))
        runtime = FixRuntime(fix, config, None, checks_enabled=True)
        fix.install(runtime)
        return runtime

    return do_install


def fixture_block(seed: int = 0, dtype=torch.float32) -> tuple[TinyMoeModel, TinyMoeSparseMoeBlock]:
    torch.manual_seed(seed)
    model = TinyMoeModel(TinyMoeConfig()).to(dtype)
    return model, model.layers[0].mlp


def forward_backward(block, hidden_states, forward=None):
    """(output, router logits, input grad, {param name: grad or None}) of one forward+backward."""
    block.zero_grad(set_to_none=True)
    leaf = hidden_states.detach().clone().requires_grad_(True)
    out, logits = block(leaf * 1.0) if forward is None else forward(block, leaf * 1.0)
    (out.float().square().sum() + logits.float().sum()).backward()
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in block.named_parameters()}
    return out.detach(), logits.detach(), leaf.grad.clone(), grads


SPARSE_FORWARD = TinyMoeSparseMoeBlock.__dict__["forward"]  # taken before any test patches the class


def sparse_forward(block, hidden_states):
    return SPARSE_FORWARD(block, hidden_states)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


# -- expert-dense on the fixture block -------------------------------------------------------------


@pytest.mark.parametrize("blocked", [[], [3], [1, 3]])
def test_dense_block_matches_sparse_outputs_and_gradients(blocked):
    model, block = fixture_block()
    hidden = torch.randn(4, 8, TinyMoeConfig.hidden_size)
    with blocked_experts(model, {0: blocked}):
        s_out, s_logits, s_xgrad, s_grads = forward_backward(block, hidden, sparse_forward)
        d_out, d_logits, d_xgrad, d_grads = forward_backward(block, hidden, expert_dense.expert_dense_forward)
    torch.testing.assert_close(d_out, s_out)
    assert torch.equal(d_logits, s_logits)
    torch.testing.assert_close(d_xgrad, s_xgrad)
    for name, grad in s_grads.items():
        assert d_grads[name] is not None, f"{name}: no gradient with expert-dense"
        if grad is None:  # an expert the sparse loop skipped: in the graph now, with a zero gradient
            assert name.startswith(tuple(f"experts.{e}." for e in blocked)), name
            assert not d_grads[name].any(), name
        else:
            torch.testing.assert_close(d_grads[name], grad, msg=name)
    assert sum(g is None for g in s_grads.values()) == 3 * len(blocked)


def test_dense_block_bfloat16_within_tolerance():
    model, block = fixture_block(dtype=torch.bfloat16)
    hidden = torch.randn(4, 8, TinyMoeConfig.hidden_size, dtype=torch.bfloat16)
    with blocked_experts(model, {0: [2]}), torch.no_grad():
        sparse, dense = sparse_forward(block, hidden)[0], expert_dense.expert_dense_forward(block, hidden)[0]
    torch.testing.assert_close(dense, sparse)


def test_dense_installed_on_fixture_checks_and_counts(install):
    model, block = fixture_block()
    runtime = install(expert_dense)
    assert TinyMoeSparseMoeBlock.forward.__moedoctor_fix__ == "expert-dense"
    hidden = torch.randn(2, 8, TinyMoeConfig.hidden_size)
    with blocked_experts(model, {0: [3]}):
        rng = torch.random.get_rng_state()
        out, _ = block(hidden)
        assert torch.equal(torch.random.get_rng_state(), rng), "the check must draw no random numbers"
        with torch.no_grad():
            torch.testing.assert_close(out, sparse_forward(block, hidden)[0])
        for _ in range(3):
            block(hidden)[0].sum().backward()
    assert block.experts[3].up_proj.weight.grad is not None
    target = runtime.targets[FIXTURE_TARGET]
    assert target.patched and target.calls == 4 and target.error is None
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is True and check.runs == 2 and check.worst < 1e-6, check  # first 2 calls only


def test_dense_check_catches_a_wrong_route(install):
    # Named without its route method, the fixture block is routed from its gate alone: the -inf
    # router bias that blocks expert 3 is lost, so dense and sparse differ and the check says so.
    model, block = fixture_block()
    runtime = install(expert_dense, {"blocks": [{"class": "_lib.moe:TinyMoeSparseMoeBlock"}]})
    assert runtime.targets[FIXTURE_TARGET].note == "from --config"
    with blocked_experts(model, {0: [0, 1]}):
        block(torch.randn(2, 8, TinyMoeConfig.hidden_size))
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is False and check.worst > 1e-3, check


class JitterBlock(nn.Module):
    """transformers 4.53's MixtralSparseMoeBlock, verbatim in substance: gate routing, always
    renormalized, multiplicative router jitter in training."""

    def __init__(self, num_experts: int = 4, top_k: int = 2, jitter_noise: float = 0.1) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.jitter_noise = num_experts, top_k, jitter_noise
        self.gate = nn.Linear(TinyMoeConfig.hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList([TinyMoeMLP(TinyMoeConfig()) for _ in range(num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = torch.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero():
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current = self.experts[expert_idx](hidden_states[None, top_x].reshape(-1, hidden_dim))
            current = current * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


def test_gate_routing_and_router_jitter_replayed_by_the_check(install):
    torch.manual_seed(0)
    block = JitterBlock().train()
    with torch.no_grad():
        block.gate.weight[1] = 0
    hidden = torch.randn(2, 8, TinyMoeConfig.hidden_size)
    torch.manual_seed(7)
    sparse, _ = block(hidden.clone())
    after_sparse = torch.random.get_rng_state()
    runtime = install(expert_dense, {"blocks": [{"class": f"{__name__}:JitterBlock"}]})
    torch.manual_seed(7)
    dense, _ = block(hidden.clone())
    assert torch.equal(torch.random.get_rng_state(), after_sparse), "the dense call draws what the sparse one did"
    torch.testing.assert_close(dense, sparse)  # same jitter, gate routing, renormalized like Mixtral
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is True and check.worst < 1e-6, check


def as_fsdp_units(block):
    """Make every expert an instance of an FSDP2-looking class (isinstance FSDPModule), no process group."""
    from torch.distributed.fsdp import FSDPModule

    unit = type("FSDPTinyMoeMLP", (FSDPModule, TinyMoeMLP), {})
    for expert in block.experts:
        expert.__class__ = unit


def test_dense_check_skipped_when_experts_are_fsdp_units(install):
    _model, block = fixture_block()
    as_fsdp_units(block)
    runtime = install(expert_dense)
    calls = []
    for expert in block.experts:
        expert.register_forward_pre_hook(lambda module, _args: calls.append(module))
    block(torch.randn(2, 8, TinyMoeConfig.hidden_size))
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is None and "FSDP2 unit" in check.detail, check
    assert len(calls) == 4, "only the dense pass may call the experts (each once, in order)"


# -- expert-zero-term on the fixture block ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_term_output_bitwise_and_every_expert_gets_a_grad(install, dtype):
    model, block = fixture_block(dtype=dtype)
    hidden = torch.randn(4, 8, TinyMoeConfig.hidden_size, dtype=dtype)
    with blocked_experts(model, {0: [1, 3]}):
        s_out, s_logits, s_xgrad, s_grads = forward_backward(block, hidden, sparse_forward)
        runtime = install(expert_zero_term)
        z_out, z_logits, z_xgrad, z_grads = forward_backward(block, hidden)
    assert torch.equal(bits(z_out), bits(s_out)) and torch.equal(z_logits, s_logits)
    assert torch.equal(z_xgrad, s_xgrad)
    for name, grad in s_grads.items():
        assert z_grads[name] is not None, f"{name}: no gradient with expert-zero-term"
        if grad is None:
            assert name.startswith(("experts.1.", "experts.3.")) and not z_grads[name].any(), name
        else:
            assert torch.equal(z_grads[name], grad), name
    check = runtime.checks[expert_zero_term.CHECK]
    assert check.passed is True and "[1, 3]" in check.detail, check
    assert runtime.targets[FIXTURE_TARGET].calls == 1


def test_zero_term_negative_zero_survives(install):
    # x + (-0.0) is x for every float; x + 0.0 would turn a -0.0 output into +0.0.
    model, block = fixture_block()
    install(expert_zero_term)
    with torch.no_grad():
        for expert in block.experts:
            expert.down_proj.weight.zero_()
    with blocked_experts(model, {0: [3]}):
        out, _ = block(-torch.ones(1, 2, TinyMoeConfig.hidden_size))
    reference = sparse_forward(block, -torch.ones(1, 2, TinyMoeConfig.hidden_size))[0]
    assert torch.equal(bits(out), bits(reference.detach()))


def test_zero_term_refuses_fsdp_expert_units(install, capsys):
    model, block = fixture_block()
    as_fsdp_units(block)
    runtime = install(expert_zero_term)
    ran = []
    for index, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(lambda _module, _args, index=index: ran.append(index))
    with blocked_experts(model, {0: [3]}):
        out, _ = block(torch.randn(2, 8, TinyMoeConfig.hidden_size))
    out.sum().backward()
    assert 3 not in ran, "refused: behaviour unchanged, the idle expert must not run"
    assert block.experts[3].up_proj.weight.grad is None
    assert any("REFUSED" in n and "use expert-dense" in n.lower() for n in runtime.notes), runtime.notes
    assert "use expert-dense" in capsys.readouterr().err.lower()
    assert runtime.checks[expert_zero_term.CHECK].passed is None


def test_zero_term_no_grad_adds_nothing(install):
    model, block = fixture_block()
    install(expert_zero_term)
    ran = []
    block.experts[3].register_forward_pre_hook(lambda _module, args: ran.append(args[0].shape[0]))
    with blocked_experts(model, {0: [3]}), torch.no_grad():
        block(torch.randn(2, 8, TinyMoeConfig.hidden_size))
    assert ran == []


# -- transformers 5.x fused experts ---------------------------------------------------------------------


def tiny_config(**extra):
    """Every attribute name the listed experts classes read, small."""
    values = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "hidden_size": 8,
              "moe_intermediate_size": 6, "intermediate_size": 6, "hidden_act": "silu", "hidden_activation": "silu",
              "_experts_implementation": "eager"}
    return types.SimpleNamespace(**values, **extra)


def load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def tiny_experts(cls, seed=0):
    torch.manual_seed(seed)
    experts = cls(tiny_config())
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def routing(tokens=10, num_experts=4, top_k=2, idle=(2,), seed=1):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=generator)
    logits[:, list(idle)] = float("-inf")
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def experts_forward_backward(experts, forward, hidden, index, weights):
    experts.zero_grad(set_to_none=True)
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = forward(experts, hidden, index, weights)
    out.square().sum().backward()
    return out.detach(), hidden.grad, weights.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}


@needs_transformers5
@pytest.mark.parametrize("path", TRANSFORMERS5_FUSED_EXPERTS, ids=lambda p: p.rpartition(":")[2])
def test_fused_experts_dense_matches_sparse(path):
    cls = load(path)
    experts = tiny_experts(cls)
    index, weights = routing()
    hidden = torch.randn(10, 8)
    sparse = experts_forward_backward(experts, cls.forward, hidden, index, weights)
    dense = experts_forward_backward(experts, expert_dense.dense_experts_forward, hidden, index, weights)
    for got, want in zip(dense[:3], sparse[:3], strict=True):
        torch.testing.assert_close(got, want)
    for name, grad in sparse[3].items():
        torch.testing.assert_close(dense[3][name], grad, msg=name)  # idle expert 2: a zero slice in both
        assert not dense[3][name][2].any()


@needs_transformers5
def test_fused_dense_drops_expert_parallel_sentinels():
    cls = load("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts")
    experts = tiny_experts(cls)
    index, weights = routing()
    index[:3, 0] = experts.num_experts  # ids of experts held by another rank
    with torch.no_grad():
        out = expert_dense.dense_experts_forward(experts, torch.randn(10, 8), index, weights)
    assert out.shape == (10, 8) and torch.isfinite(out).all()


def same_forward_as_qwen3() -> set[str]:
    """Every class of the installed transformers decorated with a plain @use_experts_implementation
    whose forward is, as a syntax tree, Qwen3MoeExperts.forward."""
    root = Path(transformers.__file__).parent
    reference = ast.dump(_forward_tree(inspect.getsource(load(
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts").forward.__wrapped__)))
    found = set()
    for path in sorted(root.glob("models/*/modeling_*.py")):
        source = path.read_text()
        if "use_experts_implementation" not in source:
            continue
        for node in ast.parse(source).body:
            if (isinstance(node, ast.ClassDef)
                    and [ast.unparse(d) for d in node.decorator_list] == ["use_experts_implementation"]):
                forward = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
                if forward is not None and ast.dump(forward) == reference:
                    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
                    found.add(f"{module}:{node.name}")
    return found


def _forward_tree(source: str) -> ast.FunctionDef:
    import textwrap

    return ast.parse(textwrap.dedent(source)).body[0]


@needs_transformers5
def test_fused_target_list_is_what_the_installed_transformers_has():
    found = same_forward_as_qwen3()
    assert set(TRANSFORMERS5_FUSED_EXPERTS) <= found, set(TRANSFORMERS5_FUSED_EXPERTS) - found
    if transformers.__version__.startswith("5.23."):  # the version the list was made from
        assert found == set(TRANSFORMERS5_FUSED_EXPERTS), found - set(TRANSFORMERS5_FUSED_EXPERTS)


@needs_transformers5
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_dense_patch_takes_effect_through_the_experts_dispatch(install, implementation):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    runtime = install(expert_dense)
    out = block(torch.randn(2, 5, 8))
    out.sum().backward()
    experts_target = runtime.targets["transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts.forward"]
    assert experts_target.patched and experts_target.calls == 1
    assert Qwen3MoeExperts.forward.__moedoctor_fix__ == "expert-dense"
    block_target = runtime.targets["transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock.forward"]
    assert not block_target.patched and "keeps these experts fused" in block_target.error
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is True, check


@needs_transformers5
def test_fused_class_of_another_layout_is_refused(install):
    gpt_oss, aria = ("transformers.models.gpt_oss.modeling_gpt_oss:GptOssExperts",
                     "transformers.models.aria.modeling_aria:AriaExperts")
    aria_cls, original = load(aria), load(aria).forward
    load(gpt_oss)
    runtime = install(expert_dense, {"blocks": [{"class": gpt_oss, "kind": "fused"}, {"class": aria, "kind": "fused"}]})
    assert "not patched" in runtime.targets[f"{gpt_oss}.forward"].error  # refused by class: its own _apply_gate
    assert runtime.targets[f"{aria}.forward"].patched  # refused by instance: transposed weights
    experts = aria_cls(types.SimpleNamespace(moe_num_experts=4, hidden_size=8, intermediate_size=6,
                                             _experts_implementation="eager"))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
        hidden, (index, weights) = torch.randn(3, 8), routing(tokens=3)
        out = experts(hidden, index, weights)
        assert torch.equal(out, original(experts, hidden, index, weights))
    assert any("is_transposed is True" in n for n in runtime.notes), runtime.notes


@needs_transformers5
def test_zero_term_says_fused_experts_need_nothing(install):
    load("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts")
    runtime = install(expert_zero_term)
    target = runtime.targets["transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts.forward"]
    assert not target.patched and target.error == "not patched: not needed: fused experts are one parameter"


# -- config -----------------------------------------------------------------------------------------------


class RoutedBlock(nn.Module):
    """A user block: experts under another name, routing from a named method."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList([TinyMoeMLP(TinyMoeConfig()) for _ in range(3)])
        self.router = nn.Linear(TinyMoeConfig.hidden_size, 3, bias=False)

    def pick(self, hidden_states):
        logits = self.router(hidden_states)
        weights, selected = torch.topk(logits.softmax(-1), 1, dim=-1)
        return logits, weights, selected

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits, weights, selected = self.pick(flat)
        out = torch.zeros_like(flat)
        for e in selected.unique().tolist():
            rows = (selected[:, 0] == e).nonzero()[:, 0]
            out.index_add_(0, rows, self.mlps[e](flat[rows]) * weights[rows])
        return out.view(hidden_states.shape), logits


@pytest.mark.parametrize("fix", [expert_dense, expert_zero_term])
def test_config_block_is_patched(install, fix):
    path = f"{__name__}:RoutedBlock"
    runtime = install(fix, {"blocks": [{"class": path, "experts": "mlps", "route": "pick"}]})
    torch.manual_seed(0)
    block = RoutedBlock()
    with torch.no_grad():
        block.router.weight[2] = 0  # make expert 2 unlikely: tokens go to 0 and 1
        block.router.weight[2, 0] = -50
    out, _ = block(torch.ones(5, TinyMoeConfig.hidden_size).abs())
    out.sum().backward()
    assert all(p.grad is not None for p in block.parameters())
    assert runtime.targets[f"{path}.forward"].patched and runtime.targets[f"{path}.forward"].calls == 1
    assert next(iter(runtime.checks.values())).passed is True


def test_config_normalized():
    section = {"blocks": [{"class": "pkg.model:Block", "route": "route"}, "pkg.model:Other",
                          {"class": "pkg.fused:Experts", "kind": "fused"}]}
    config = expert_dense.FIX.parse_config(section)
    assert config == {
        "blocks": [{"class": "pkg.model:Block", "kind": "modulelist", "experts": "experts", "route": "route"},
                   {"class": "pkg.model:Other", "kind": "modulelist", "experts": "experts", "route": None},
                   {"class": "pkg.fused:Experts", "kind": "fused", "experts": "experts", "route": None}],
        "targets": ["pkg.model:Block.forward", "pkg.model:Other.forward", "pkg.fused:Experts.forward"]}
    extra = [t for t in expert_dense.FIX.all_targets(config) if t.note == "from --config"]
    assert [t.path for t in extra] == config["targets"]
    assert expert_dense.FIX.parse_config({}) == {"blocks": [], "targets": []}


@pytest.mark.parametrize(("section", "message"), [
    ({"block": []}, "unknown key(s) ['block']; expected 'blocks'"),
    ({"blocks": "pkg:Block"}, "blocks: expected a list"),
    ({"blocks": [3]}, "blocks[0]: expected a mapping"),
    ({"blocks": [{"kind": "fused"}]}, "blocks[0].class: required"),
    ({"blocks": [{"class": "pkg.Block"}]}, "blocks[0].class: expected 'module:Class'"),
    ({"blocks": [{"class": ""}]}, "blocks[0].class: expected 'module:Class'"),
    ({"blocks": [{"class": "pkg:Block.forward"}]}, "blocks[0].class: name the class, not its method"),
    ({"blocks": [{"class": "pkg:A"}, {"class": "pkg:B", "kind": "sparse"}]},
     "blocks[1].kind: expected one of modulelist, fused"),
    ({"blocks": [{"class": "pkg:A", "kind": "fused", "route": "route"}]}, "blocks[0].route: only for kind: modulelist"),
    ({"blocks": [{"class": "pkg:A", "experts": "my experts"}]}, "blocks[0].experts: expected an attribute name"),
    ({"blocks": [{"class": "pkg:A", "route": 3}]}, "blocks[0].route: expected a method name"),
    ({"blocks": [{"class": "pkg:A", "gate": "gate"}]}, "blocks[0]: unknown key(s) ['gate']"),
    ({"blocks": ["pkg:A", "pkg:A"]}, "blocks[1].class: pkg:A is named twice"),
])
def test_config_errors_name_the_key(section, message):
    with pytest.raises(FixConfigError) as error:
        expert_dense.FIX.parse_config(section)
    assert message in error.value.message


def test_zero_term_config_takes_modulelist_blocks_only():
    with pytest.raises(FixConfigError, match=r"blocks\[0\]\.kind: expert-zero-term does not handle 'fused'.*one "
                                             r"parameter"):
        expert_zero_term.FIX.parse_config({"blocks": [{"class": "pkg:Experts", "kind": "fused"}]})


def test_registry_lists_both_for_the_pattern():
    from moedoctor.fixes import fixes_for_pattern

    names = [fix.name for fix in fixes_for_pattern("inactive-experts")]
    assert names[:2] == ["expert-dense", "expert-zero-term"]
    assert FIXTURE_TARGET in [t.path for t in expert_dense.FIX.targets]
    # the fixture's block, three transformers 4.x blocks and Qwen2-MoE's (with its shared expert)
    assert len(expert_dense.FIX.targets) == 1 + 3 + 1 + len(TRANSFORMERS5_FUSED_EXPERTS)
    assert len(expert_zero_term.FIX.targets) == 1 + 3 + 1  # the fused classes are only watched, to say "not needed"


# -- the check compares the case the fix is for: a forward where an expert gets no token ----------------


def finish(runtime):
    for callback in runtime.finishers:  # what the job's end runs (a rank; here no process group)
        callback()


def test_dense_check_forces_an_idle_expert_when_no_call_has_one(install):
    _model, block = fixture_block()
    runtime = install(expert_dense)
    hidden = torch.randn(4, 16, TinyMoeConfig.hidden_size)
    with torch.no_grad():
        assert not expert_dense.idle_experts(block.route(hidden.view(-1, hidden.shape[-1]))[2], 4), "pick busier input"
    block(hidden)
    block(hidden)
    finish(runtime)
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is True, check
    assert "1 with an idle expert" in check.detail and "forced on one token of a checked call" in check.detail, check.detail


def test_dense_check_fails_when_the_fix_leaks_an_unrouted_expert(install, monkeypatch):
    """The fix broken where it matters (an expert a token was not routed to adds a little to it):
    the check, comparing a forward with an idle expert, must fail."""
    dense_weights = expert_dense.dense_weights

    def leaky(selected, weights, num_experts):
        return dense_weights(selected, weights, num_experts) + 1e-2

    monkeypatch.setattr(expert_dense, "dense_weights", leaky)
    model, block = fixture_block()
    runtime = install(expert_dense)
    with blocked_experts(model, {0: [3]}):
        block(torch.randn(2, 8, TinyMoeConfig.hidden_size))
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is False and "idle expert(s) [3]" in check.detail, check


def test_dense_check_fails_not_shown_when_no_expert_can_be_idle(install):
    """Every expert on every token (top_k == num_experts): no compared forward can have an idle
    expert, so the check has not shown the fix's case and fails, saying so."""
    _model, block = fixture_block()
    block.top_k = len(block.experts)
    runtime = install(expert_dense)
    block(torch.randn(2, 8, TinyMoeConfig.hidden_size))
    finish(runtime)
    check = runtime.checks[expert_dense.CHECK]
    assert check.passed is False and check.detail.startswith("not shown: 1 call compared"), check
    assert "routes one token to every expert" in check.detail, check.detail


def test_zero_term_check_fails_when_the_fix_leaks_the_idle_experts_output(install, monkeypatch):
    """The fix broken (the idle experts run on the real tokens and their output is added, scaled
    down, instead of a zero term): the output changes and the bitwise check must fail."""
    monkeypatch.setattr(expert_zero_term, "_no_tokens", lambda h: h.detach().reshape(-1, h.shape[-1]))
    monkeypatch.setattr(expert_zero_term, "_ZERO", 1e-3)
    model, block = fixture_block()
    runtime = install(expert_zero_term)
    with blocked_experts(model, {0: [3]}):
        block(torch.randn(2, 8, TinyMoeConfig.hidden_size, requires_grad=True))
    check = runtime.checks[expert_zero_term.CHECK]
    assert check.passed is False and "CHANGED" in check.detail and check.worst > 0, check
