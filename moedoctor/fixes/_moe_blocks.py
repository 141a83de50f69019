"""What ``expert-dense`` and ``expert-zero-term`` share: the MoE classes they patch, the ``blocks:``
section of ``--config``, and the tests a block or experts instance must pass at its first call.

Two kinds of target:

* ``modulelist``: a block whose experts are an ``nn.ModuleList`` of expert modules and whose
  ``forward(hidden_states)`` returns ``(hidden_states, router_logits)`` (transformers 4.x Qwen3-MoE,
  Mixtral, OLMoE; moedoctor's fixture). Its routing comes from a named method returning
  ``(router_logits, routing_weights[T, k], selected_experts[T, k])`` for the flattened hidden states,
  or, without one, the transformers-4.x way from ``self.gate``.
* ``fused``: a transformers 5.x experts module with 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj``
  [E, H, I], ``act_fn`` and ``forward(hidden_states, top_k_index, top_k_weights)``.

No torch at import: the registry is read by the supervisor. The helpers that take tensors import it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moedoctor.fixes.base import FixConfigError, Target

MODULELIST = "modulelist"
FUSED = "fused"
KINDS = (MODULELIST, FUSED)

FIXTURE_BLOCK = "_lib.moe:TinyMoeSparseMoeBlock"

# transformers 4.x sparse blocks, read in 4.53.2 and run against it: nn.ModuleList experts, an
# nn.Linear gate, softmax in float + topk(top_k) (+ renormalization when norm_topk_prob, always
# for Mixtral), forward(hidden_states) -> (hidden_states, router_logits). Mixtral's training-time
# router jitter is reproduced. In 5.x the same classes hold fused experts: refused there, the fused
# experts are the target. Qwen2MoeSparseMoeBlock also adds a gated shared expert
# (``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, after the routed sum), which the dense
# forward adds the same way (``BlockSpec.shared_expert``).
TRANSFORMERS4_SHARED_EXPERT_BLOCKS = ("transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeSparseMoeBlock",)
TRANSFORMERS4_BLOCKS = (
    "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock",
    "transformers.models.mixtral.modeling_mixtral:MixtralSparseMoeBlock",
    "transformers.models.olmoe.modeling_olmoe:OlmoeSparseMoeBlock",
)

# transformers 5.x fused experts whose ``forward`` is, in 5.23, the same code as Qwen3MoeExperts'
# (compared as syntax trees), whose __init__ builds the same parameter layout, and whose class is
# decorated with a plain ``@use_experts_implementation`` (no bias, not transposed, concatenated
# gate/up, gated, no post-expert norm). tests/unit/test_fix_expert_dense.py re-derives this list
# from the installed transformers and runs every class. Left out: Aria (transposed), GPT-OSS and
# OpenAI privacy filter (bias, transposed), MuseSpark (post-expert norm), NemotronH (no gate),
# DeepseekV4, Beam, Glm5Next, HYV4, Inkling2, MiniMaxM3VL (own forward and gating).
TRANSFORMERS5_FUSED_EXPERTS = (
    "transformers.models.afmoe.modeling_afmoe:AfmoeExperts",
    "transformers.models.axk1.modeling_axk1:AXK1Experts",
    "transformers.models.axk2.modeling_axk2:AXK2Experts",
    "transformers.models.bailing_hybrid.modeling_bailing_hybrid:BailingHybridExperts",
    "transformers.models.cohere2_moe.modeling_cohere2_moe:Cohere2MoeExperts",
    "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2:DeepseekOcr2TextExperts",
    "transformers.models.deepseek_v2.modeling_deepseek_v2:DeepseekV2Experts",
    "transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3Experts",
    "transformers.models.deepseek_v32.modeling_deepseek_v32:DeepseekV32Experts",
    "transformers.models.diffusion_gemma.modeling_diffusion_gemma:DiffusionGemmaTextExperts",
    "transformers.models.dots1.modeling_dots1:Dots1Experts",
    "transformers.models.dots3_note.modeling_dots3_note:Dots3NoteExperts",
    "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe:Ernie4_5_MoeExperts",
    "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe:Ernie4_5_VLMoeMoeExperts",
    "transformers.models.exaone_moe.modeling_exaone_moe:ExaoneMoeExperts",
    "transformers.models.flex_olmo.modeling_flex_olmo:FlexOlmoExperts",
    "transformers.models.flint.modeling_flint:FlintExperts",
    "transformers.models.gemma4.modeling_gemma4:Gemma4TextExperts",
    "transformers.models.glm4_moe.modeling_glm4_moe:Glm4MoeExperts",
    "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite:Glm4MoeLiteExperts",
    "transformers.models.glm4v_moe.modeling_glm4v_moe:Glm4vMoeTextExperts",
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa:GlmMoeDsaExperts",
    "transformers.models.granitemoe.modeling_granitemoe:GraniteMoeExperts",
    "transformers.models.granitemoe_swa.modeling_granitemoe_swa:GraniteMoeSWAExperts",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid:GraniteMoeHybridExperts",
    "transformers.models.granitemoeshared.modeling_granitemoeshared:GraniteMoeSharedExperts",
    "transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe:HunYuanMoEV1Experts",
    "transformers.models.hy_v3.modeling_hy_v3:HYV3Experts",
    "transformers.models.inkling.modeling_inkling:InklingExperts",
    "transformers.models.jamba.modeling_jamba:JambaExperts",
    "transformers.models.kimi_linear.modeling_kimi_linear:KimiLinearExperts",
    "transformers.models.kolibri1.modeling_kolibri1:Kolibri1Experts",
    "transformers.models.laguna.modeling_laguna:LagunaExperts",
    "transformers.models.lfm2_moe.modeling_lfm2_moe:Lfm2MoeExperts",
    "transformers.models.mellum.modeling_mellum:MellumExperts",
    "transformers.models.mimo_v2_flash.modeling_mimo_v2_flash:MiMoV2FlashExperts",
    "transformers.models.minimax.modeling_minimax:MiniMaxExperts",
    "transformers.models.minimax_m2.modeling_minimax_m2:MiniMaxM2Experts",
    "transformers.models.mistral4.modeling_mistral4:Mistral4Experts",
    "transformers.models.mistral_large4.modeling_mistral_large4:MistralLarge4TextExperts",
    "transformers.models.mixtral.modeling_mixtral:MixtralExperts",
    "transformers.models.olmoe.modeling_olmoe:OlmoeExperts",
    "transformers.models.phimoe.modeling_phimoe:PhimoeExperts",
    "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeExperts",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeExperts",
    "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts",
    "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextExperts",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe:Qwen3OmniMoeTalkerTextExperts",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe:Qwen3OmniMoeThinkerTextExperts",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeTextExperts",
    "transformers.models.qwen4_exp.modeling_qwen4_exp:Qwen4ExpTextExperts",
    "transformers.models.solar_open.modeling_solar_open:SolarOpenExperts",
    "transformers.models.unlimited_ocr.modeling_unlimited_ocr:UnlimitedOcrTextExperts",
    "transformers.models.zaya.modeling_zaya:ZayaExperts",
)

# Numerical checks run, per instance and rank, on its first CHECKED_CALLS calls and on its first
# CHECKED_CALLS calls with an idle expert (the calls the fix is for).
CHECKED_CALLS = 2


@dataclass(frozen=True)
class BlockSpec:
    """One class to patch (its ``forward``) and how to read it."""

    cls: str  # "package.module:Class"
    kind: str = MODULELIST
    experts: str = "experts"  # modulelist: the attribute holding the experts
    route: str | None = None  # modulelist: a method returning (logits, weights, selected)
    note: str = ""
    transformers4: bool = False  # a transformers 4.x block: refused under transformers 5
    shared_expert: bool = False  # adds sigmoid(shared_expert_gate(x)) * shared_expert(x) (Qwen2-MoE)

    @property
    def target(self) -> Target:
        return Target(f"{self.cls}.forward", self.note)

    @property
    def name(self) -> str:
        return self.cls.rpartition(":")[2]


def builtin_specs() -> tuple[BlockSpec, ...]:
    return (
        BlockSpec(FIXTURE_BLOCK, route="route", note="moedoctor's fixtures"),
        *(
            BlockSpec(path, note="transformers 4.x (checked against 4.53.2)", transformers4=True)
            for path in TRANSFORMERS4_BLOCKS
        ),
        *(
            BlockSpec(path, note="transformers 4.x (checked against 4.53.2)", transformers4=True, shared_expert=True)
            for path in TRANSFORMERS4_SHARED_EXPERT_BLOCKS
        ),
        *(BlockSpec(path, kind=FUSED, note="transformers 5.x fused experts") for path in TRANSFORMERS5_FUSED_EXPERTS),
    )


def builtin_targets(kinds: tuple[str, ...] = KINDS) -> tuple[Target, ...]:
    return tuple(spec.target for spec in builtin_specs() if spec.kind in kinds)


def parse_blocks_config(section: Mapping[str, Any], fix_name: str, kinds: tuple[str, ...] = KINDS) -> dict:
    """Validate a ``blocks:`` section; returns ``{"blocks": [...], "targets": [...]}`` in plain JSON types.

    ``targets`` lists the patched ``Class.forward`` paths, which ``Fix.all_targets`` reports."""
    unknown = set(section) - {"blocks"}
    if unknown:
        raise FixConfigError(f"unknown key(s) {sorted(unknown)}; expected 'blocks'")
    blocks = section.get("blocks", [])
    if not isinstance(blocks, list):
        raise FixConfigError(f"blocks: expected a list of {{class: 'module:Class', ...}}, got {blocks!r}")
    parsed: list[dict] = []
    for i, entry in enumerate(blocks):
        where = f"blocks[{i}]"
        if isinstance(entry, str):
            entry = {"class": entry}
        if not isinstance(entry, dict):
            raise FixConfigError(
                f"{where}: expected a mapping with 'class' (and 'kind', 'experts', 'route'), got {entry!r}"
            )
        unknown = set(entry) - {"class", "kind", "experts", "route"}
        if unknown:
            raise FixConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected class, kind, experts, route")
        if "class" not in entry:
            raise FixConfigError(f"{where}.class: required ('module:Class', the block whose forward is patched)")
        cls = _class_path(entry["class"], f"{where}.class")
        kind = entry.get("kind", MODULELIST)
        if kind not in KINDS:
            raise FixConfigError(f"{where}.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        if kind not in kinds:
            raise FixConfigError(
                f"{where}.kind: {fix_name} does not handle {kind!r} classes"
                + ("; fused experts are one parameter and need no zero term" if kind == FUSED else "")
            )
        if kind == FUSED and ({"experts", "route"} & set(entry)):
            bad = min({"experts", "route"} & set(entry))
            raise FixConfigError(
                f"{where}.{bad}: only for kind: modulelist (a fused class is the experts module "
                "itself and takes its routing as arguments)"
            )
        experts = entry.get("experts", "experts")
        if not isinstance(experts, str) or not experts.isidentifier():
            raise FixConfigError(f"{where}.experts: expected an attribute name, got {experts!r}")
        route = entry.get("route")
        if route is not None and (not isinstance(route, str) or not route.isidentifier()):
            raise FixConfigError(f"{where}.route: expected a method name, got {route!r}")
        if any(p["class"] == cls for p in parsed):
            raise FixConfigError(f"{where}.class: {cls} is named twice")
        parsed.append({"class": cls, "kind": kind, "experts": experts, "route": route})
    return {"blocks": parsed, "targets": [f"{p['class']}.forward" for p in parsed]}


def _class_path(value: Any, where: str) -> str:
    text = value.strip() if isinstance(value, str) else None
    module, _, qualname = (text or "").partition(":")
    if (
        not text
        or not module
        or not qualname
        or not all(p.isidentifier() for p in module.split("."))
        or not all(p.isidentifier() for p in qualname.split("."))
    ):
        raise FixConfigError(f"{where}: expected 'module:Class', got {value!r}")
    if qualname.endswith(".forward"):
        raise FixConfigError(f"{where}: name the class, not its method ({value!r}); its forward is patched")
    return text


def specs_for(config: Mapping[str, Any], kinds: tuple[str, ...] = KINDS) -> list[BlockSpec]:
    """The built-in specs plus those of ``--config``; a configured class replaces a built-in one."""
    configured = [
        BlockSpec(b["class"], b["kind"], b["experts"], b["route"], "from --config") for b in config.get("blocks", ())
    ]
    named = {spec.cls for spec in configured}
    return [spec for spec in builtin_specs() if spec.kind in kinds and spec.cls not in named] + configured


def transformers_version() -> str | None:
    import sys

    module = sys.modules.get("transformers")
    return getattr(module, "__version__", None) if module is not None else None


def require_transformers4(spec: BlockSpec, fused_hint: str) -> None:
    """Raise (so the runtime records "not patched: ...") for a 4.x block under transformers 5."""
    version = transformers_version()
    if spec.transformers4 and version is not None and int(version.split(".")[0]) >= 5:
        raise RuntimeError(f"transformers {version} keeps these experts fused; {fused_hint}")


def check_forward_signature(original: Any, names: tuple[str, ...]) -> None:
    """The original ``forward`` must take exactly ``names`` after ``self`` (extra ones only optional)."""
    import inspect

    if not callable(original):
        raise TypeError(f"{original!r} is not callable")
    params = list(inspect.signature(original).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_extra = [
        p.name for p in params[len(names) :] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if len(positional) < len(names) or required_extra:
        raise TypeError(f"forward takes ({', '.join(p.name for p in params)}), expected ({', '.join(names)})")


class PerInstance:
    """Small state per patched module instance (weakly keyed: modules come and go)."""

    def __init__(self, factory) -> None:
        self._factory = factory
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, module: Any) -> Any:
        state = self._states.get(module)
        if state is None:
            state = self._states[module] = self._factory(module)
        return state


# -- torch side --------------------------------------------------------------------------------------


def sharded_experts_reason(experts: Any) -> str | None:
    """Why calling some experts but not others would issue collectives: each expert (or its
    parameters) gathered by its own hooks: FSDP2 ``fully_shard``, FSDP1, DeepSpeed ZeRO-3."""
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp2: tuple[type, ...] = (FSDPModule,)
    except ImportError:  # a torch without distributed
        fsdp2 = ()
    for index, expert in enumerate(experts):  # cheap enough for every call: one parameter per expert
        if isinstance(expert, fsdp2):
            return f"expert {index} is its own FSDP2 unit (fully_shard)"
        if type(expert).__name__ == "FullyShardedDataParallel":
            return f"expert {index} is its own FSDP (1) unit"
        if hasattr(next(expert.parameters(), None), "ds_id"):  # DeepSpeed tags every parameter it partitions
            return f"expert {index} has DeepSpeed ZeRO-3 partitioned parameters"
    return None


def modulelist_problem(block: Any, spec: BlockSpec, routing: bool = True) -> str | None:
    """Why ``block`` does not fit the modulelist adapter (None: it fits); ``routing``: it must also
    be routable by ``route_tokens``."""
    from torch import nn

    experts = getattr(block, spec.experts, None)
    if not isinstance(experts, nn.ModuleList):
        return f"its {spec.experts!r} is a {type(experts).__name__}, not an nn.ModuleList of experts"
    if len(experts) == 0:
        return f"its {spec.experts!r} is empty"
    num_experts = getattr(block, "num_experts", len(experts))
    if num_experts != len(experts):
        return f"num_experts is {num_experts} but {spec.experts!r} holds {len(experts)}"
    if not routing:
        return None
    if spec.route is not None:
        if not callable(getattr(block, spec.route, None)):
            return f"it has no method {spec.route!r} (the configured route)"
        return None
    if not callable(getattr(block, "gate", None)):
        return "it has no 'gate' router (name a route method in --config)"
    if not isinstance(getattr(block, "top_k", None), int):
        return "it has no integer 'top_k' (name a route method in --config)"
    return None


def route_tokens(block: Any, hidden_states: Any, spec: BlockSpec) -> tuple[Any, Any, Any]:
    """(router_logits, routing_weights[T, k], selected_experts[T, k]) for flattened hidden states."""
    import torch
    import torch.nn.functional as F

    if spec.route is not None:
        return getattr(block, spec.route)(hidden_states)
    router_logits = block.gate(hidden_states)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):  # Mixtral has no flag and always renormalizes
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    return router_logits, routing_weights.to(hidden_states.dtype), selected_experts


def apply_router_jitter(block: Any, hidden_states: Any, spec: BlockSpec) -> None:
    """Mixtral's training-time multiplicative jitter, in place and drawing the same random numbers."""
    import torch

    jitter = getattr(block, "jitter_noise", 0) or 0
    if spec.route is None and block.training and jitter > 0:
        hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)


def dense_weights(selected: Any, weights: Any, num_experts: int) -> Any:
    """[T, E] routing weights, zero where a token was not routed; ids >= E (expert-parallel
    sentinels for experts held elsewhere) are dropped."""
    import torch

    ids = torch.where(selected < num_experts, selected, torch.full_like(selected, num_experts))
    full = weights.new_zeros(weights.shape[0], num_experts + 1)
    return full.scatter_add(1, ids, weights)[:, :num_experts]


_TOLERANCES = {  # (rtol, atol): dense and sparse differ only in which rows each matmul sees
    "torch.float64": (1e-9, 1e-10),
    "torch.float32": (1e-4, 1e-5),
    "torch.float16": (2e-3, 1e-3),
    "torch.bfloat16": (2e-2, 1e-2),
}


def compare(dense: Any, sparse: Any) -> tuple[bool, float, str]:
    """(within tolerance, max |dense - sparse|, how the tolerance reads)."""
    import torch

    rtol, atol = _TOLERANCES.get(str(sparse.dtype), (2e-2, 1e-2))
    diff = (dense.detach().double() - sparse.detach().double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    bound = atol + rtol * sparse.detach().double().abs()
    passed = bool(torch.all(diff <= bound))  # a NaN anywhere fails
    return passed, worst, f"rtol {rtol:g}, atol {atol:g} for {str(sparse.dtype).removeprefix('torch.')}"


def rng_state(tensor: Any) -> tuple[Any, Any]:
    """The CPU generator's state and that of ``tensor``'s CUDA device (None on CPU)."""
    import torch

    cuda = torch.cuda.get_rng_state(tensor.device) if tensor.device.type == "cuda" else None
    return torch.random.get_rng_state(), cuda


@contextlib.contextmanager
def replayed_rng(tensor: Any, state: tuple[Any, Any]) -> Iterator[None]:
    """Run the block with the generators as they were at ``state``, and leave them afterwards as they
    are now: a check draws the same random numbers as the call it checks (Mixtral's router jitter),
    and none of the job's."""
    import torch

    cpu, cuda = state
    with torch.random.fork_rng(devices=[tensor.device] if cuda is not None else []):
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, tensor.device)
        yield


def idle_experts(selected: Any, num_experts: int) -> list[int]:
    """Experts no token was routed to (ids >= num_experts are expert-parallel sentinels)."""
    import torch

    ids = selected.flatten()
    counts = torch.bincount(ids[ids < num_experts], minlength=num_experts)
    return (counts == 0).nonzero().flatten().tolist()


def fused_problem(experts: Any, hidden_states: Any) -> str | None:
    """Why a fused experts instance does not have the layout the dense loop assumes (None: it has)."""
    flags = (
        ("has_bias", False),
        ("is_transposed", False),
        ("is_concatenated", True),
        ("has_gate", True),
        ("has_post_expert_norm", False),
        ("_is_expert_parallel", False),
    )
    for flag, expected in flags:
        if getattr(experts, flag, expected) != expected:
            return f"{flag} is {getattr(experts, flag)!r}, the dense loop handles {expected!r} only"
    num_experts = getattr(experts, "num_experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(num_experts, int) or gate_up is None or down is None:
        return "it lacks num_experts, gate_up_proj or down_proj"
    if any(getattr(experts, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
        return "its projections have biases"
    if not callable(getattr(experts, "act_fn", None)):
        return "it has no act_fn"
    hidden = hidden_states.shape[-1]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        return (
            f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not "
            f"[{num_experts}, 2I, H] / [{num_experts}, H, I]"
        )
    intermediate = down.shape[2]
    if tuple(gate_up.shape[1:]) != (2 * intermediate, hidden) or down.shape[1] != hidden:
        return (
            f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} do not match "
            f"[E, 2I, H] / [E, H, I] with H = {hidden}"
        )
    return None


def first_tensor(output: Any) -> Any:
    """The hidden states of a block's output: the tensor itself or the first item of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_first_tensor(output: Any, hidden: Any) -> Any:
    """``output`` with its hidden states (``first_tensor``) replaced by ``hidden``."""
    return type(output)((hidden, *output[1:])) if isinstance(output, (tuple, list)) else hidden
