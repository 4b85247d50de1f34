"""The vocabulary projection both the engine and the trainer use, so their logprobs agree.

bf16 operands, fp32 output. Rounding the logits themselves to bf16 (what ``model.lm_head`` returns) moves
each by up to half a bf16 step, 0.03 at |logit| ~ 8: on the H200 with SmolLM2-135M at lr 0 that alone made
the engine's and the trainer's logprobs differ by 4e-2 nats on average (bench/results/h200/train_gpu).

unison computes logits itself, so whatever a model class's forward does to ``self.lm_head(hidden)`` must be
done here too: Gemma2's final softcapping, Granite's ``logits_scaling``, Cohere's ``logit_scale``, FalconH1's
``lm_head_multiplier`` (every head transform of the transformers 5.24 causal LMs is in ``_TRANSFORMS``).
``lm_head_of`` reads it once from the model and refuses a forward that does anything else to its logits.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def lm_head_fp32(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden: (N, H); weight: (V, H), same dtype. Returns (N, V) float32 = hidden @ weight.T, accumulated and
    returned in fp32 without materialising an fp32 copy of the weight on the GPU; written into ``out`` (N, V)
    float32 where given (the engine's graphs: one buffer for every batch size)."""
    if weight.dtype == torch.float32:
        return torch.mm(hidden.float(), weight.T, out=out)
    if hidden.is_cuda:
        return torch.mm(hidden, weight.T, out_dtype=torch.float32, out=out)
    return torch.mm(hidden.float(), weight.float().T, out=out)


@dataclass(frozen=True)
class HeadTransform:
    """What a model does to ``x = hidden @ W.T``: ``softcap * tanh(scale * x / softcap)``, or ``scale * x``
    without a softcap. The identity (scale 1, no softcap) costs no operation."""

    scale: float = 1.0
    """Granite: 1 / logits_scaling; Cohere: logit_scale; FalconH1: lm_head_multiplier."""
    softcap: float | None = None
    """Gemma2 (and Gemma3 when set): final_logit_softcapping."""

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply_(self, x: torch.Tensor, inv_temp: float = 1.0) -> torch.Tensor:
        """x: (N, V) float32 raw logits, overwritten with transform(x) * inv_temp and returned."""
        if self.softcap is None:
            return x if self.scale * inv_temp == 1.0 else x.mul_(self.scale * inv_temp)
        if self.scale != 1.0:
            x.mul_(self.scale)
        return x.div_(self.softcap).tanh_().mul_(self.softcap * inv_temp)

    def backward_(self, grad: torch.Tensor, z: torch.Tensor, inv_temp: float = 1.0) -> torch.Tensor:
        """grad: (N, V) float32 d loss / d z, where z = ``apply_(x, inv_temp)``; overwritten with d loss / d x.
        z is consumed (overwritten) when there is a softcap."""
        grad.mul_(self.scale * inv_temp)
        if self.softcap is not None:  # d tanh(u) / du = 1 - tanh(u)^2, and tanh(u) = z / (softcap * inv_temp)
            grad.mul_(z.mul_(1.0 / (self.softcap * inv_temp)).square_().neg_().add_(1.0))
        return grad


IDENTITY = HeadTransform()


@dataclass(frozen=True)
class LMHead:
    """The model's output projection and its head transform: the logits the model's own forward computes, in fp32.

    >>> head = lm_head_of(model)        # doctest: +SKIP
    >>> logits = head(hidden)           # (N, V) float32
    """

    weight: torch.Tensor = field(repr=False)
    """(V, H), the model's own Parameter (tied to the input embedding where the model ties them)."""
    transform: HeadTransform = IDENTITY

    def __call__(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: (N, H) in the weight's dtype. Returns (N, V) float32 logits, in ``out`` where given."""
        return self.transform.apply_(lm_head_fp32(hidden, self.weight, out))


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base model that returns final hidden states (``model.model`` for Llama, Qwen3, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if decoder is None or decoder is model:
        raise ValueError(f"cannot find the decoder of {type(model).__name__}")
    return decoder


def _softcap(cap: float | None, scale: float = 1.0) -> HeadTransform:
    return HeadTransform(scale=scale, softcap=cap)


def _text(model: torch.nn.Module):
    return model.config.get_text_config()


# What each class's forward does after ``logits = self.lm_head(hidden)``, read from the transformers 5.24 sources
# (every ForCausalLM and ForConditionalGeneration that changes its logits). Keyed by the class defining forward.
_TRANSFORMS: dict[str, Callable[[torch.nn.Module], HeadTransform]] = {
    **dict.fromkeys(("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM", "Gemma4ForCausalLM",
                     "Gemma4UnifiedForCausalLM", "VaultGemmaForCausalLM", "NanoChatForCausalLM", "BeamForCausalLM"),
                    lambda m: _softcap(m.config.final_logit_softcapping)),
    **dict.fromkeys(("Gemma3nForConditionalGeneration", "Gemma4ForConditionalGeneration",
                     "Gemma4UnifiedForConditionalGeneration", "PaliGemmaForConditionalGeneration",
                     "MistralLarge4ForConditionalGeneration"),
                    lambda m: _softcap(getattr(_text(m), "final_logit_softcapping", None))),
    **dict.fromkeys(("MuseGlimmerForConditionalGeneration", "MuseSparkForConditionalGeneration"),
                    lambda m: _softcap(_text(m).final_logit_softcapping, _text(m).output_multiplier)),
    **dict.fromkeys(("Inkling2ForCausalLM", "Inkling2LoopForCausalLM", "Inkling2ForConditionalGeneration",
                     "Inkling2LoopForConditionalGeneration"), lambda m: _softcap(m.logit_softcap.softcap)),
    "RecurrentGemmaForCausalLM": lambda m: _softcap(m.config.logits_soft_cap),
    "xLSTMForCausalLM": lambda m: _softcap(m.config.output_logit_soft_cap),
    # logits / logits_scaling (muP); HyperCLOVAX multiplies by its attribute of the same name.
    **dict.fromkeys(("GraniteForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeForCausalLM",
                     "GraniteMoeSWAForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSharedForCausalLM"),
                    lambda m: HeadTransform(scale=1.0 / m.config.logits_scaling)),
    **dict.fromkeys(("Granite4VisionForConditionalGeneration", "GraniteDoclingForConditionalGeneration"),
                    lambda m: HeadTransform(scale=1.0 / _text(m).logits_scaling)),
    "HyperCLOVAXForCausalLM": lambda m: HeadTransform(scale=m.config.logits_scaling),
    "HyperCLOVAXVisionV2ForConditionalGeneration": lambda m: HeadTransform(scale=_text(m).logits_scaling),
    # logits * self.logit_scale (None in CohereCompass: no scaling)
    **dict.fromkeys(("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForCausalLM",
                     "CohereCompassForConditionalGeneration"),
                    lambda m: HeadTransform(scale=1.0 if m.logit_scale is None else m.logit_scale)),
    "FalconH1ForCausalLM": lambda m: HeadTransform(scale=m.model.lm_head_multiplier),
}

def lm_head_of(model: torch.nn.Module) -> LMHead:
    """The model's output projection and head transform, or a ValueError naming the class and what unison cannot
    compute: a head that is not a bias-free ``nn.Linear``, or a forward outside ``_TRANSFORMS`` that does anything
    to its logits but ``logits = self.lm_head(hidden)`` (read from its source, so a new class or a subclass that
    overrides forward is refused rather than silently mis-scaled)."""
    name = type(model).__name__
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise ValueError(f"{name}: unison needs an nn.Linear lm_head, got {type(head).__name__}")
    if head.bias is not None:
        raise ValueError(f"{name}: unison needs a bias-free lm_head")
    owner = next(c for c in type(model).__mro__ if "forward" in vars(c))
    reader = _TRANSFORMS.get(owner.__name__) if owner.__module__.startswith("transformers.") else None
    if reader is not None:
        return LMHead(head.weight, _checked(name, reader(model)))
    head_attr = next((n for n, c in model.named_children() if c is head), None)
    unknown = _unknown_logit_steps(owner, head_attr)
    if unknown:
        raise ValueError(f"{name}: {owner.__name__}.forward changes its logits in a way unison does not compute: "
                         + "; ".join(unknown))
    return LMHead(head.weight)


def _checked(name: str, transform: HeadTransform) -> HeadTransform:
    cap = transform.softcap
    if cap is not None and not cap > 0:
        raise ValueError(f"{name}: final logit softcap {cap!r} must be > 0")
    return HeadTransform(float(transform.scale), None if cap is None else float(cap))


_PASS_THROUGH = {"float", "contiguous"}  # methods that leave fp32 logits' values unchanged


@functools.cache
def _unknown_logit_steps(cls: type, head_attr: str | None) -> tuple[str, ...]:
    """The statements of ``cls.forward`` that compute or change the logits other than ``self.<head_attr>(x)``
    (optionally ``.float()`` / ``.contiguous()``); a forward that never calls the head is one such step."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return ("its source cannot be read",)

    def unwrap(node: ast.expr) -> ast.expr:
        while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args
               and node.func.attr in _PASS_THROUGH):
            node = node.func.value
        return node

    def is_logits(node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in ("logits", "lm_logits")

    def is_head_call(node: ast.expr) -> bool:
        return (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
                and isinstance(node.func, ast.Attribute) and node.func.attr == head_attr
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")

    unknown, calls_head = [], False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
                     for t in targets]
            if not any(n in ("logits", "lm_logits") for n in names):
                continue
            value = unwrap(node.value) if isinstance(node, ast.Assign) else None
            if value is not None and is_head_call(value):
                calls_head = True
            elif value is None or not is_logits(value):
                unknown.append(ast.unparse(node))
        elif isinstance(node, ast.keyword) and node.arg == "logits" and not is_logits(unwrap(node.value)):
            unknown.append(f"logits={ast.unparse(node.value)}")
    if not calls_head:
        unknown.append(f"no `logits = self.{head_attr or '<output embeddings>'}(hidden_states)`")
    return tuple(unknown)
