"""The packed-row leak test: one sample's tokens must not change another sample's outputs, by a single bit.

A tolerance cannot tell a small leak from noise: FalconH1's Mamba layers leaked 0.02-0.035 relative across a
boundary, and one seed in six passed the former 2e-2 threshold. Perturbing one sample keeps every shape in the
row the same, so any change at all in another sample's outputs is a path between them (attention across the
boundary, a conv window or a recurrent state carried over), never kernel noise. The one batching effect found
(on the CPU, over tests/test_architectures_attention.py's families, Llama, Qwen3 and the four hybrids) is a
mixture of experts' grouped matmuls; the check runs those one token at a time (``experts_per_token``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..engine import cudnn_attention
from ..engine.attention import ATTN_NAME, NO_MASK
from ..engine.lm_head import decoder_of
from .boundaries import keep_samples_apart

LENGTHS = (5, 7, 6)  # three samples: a perturbed one has a neighbour on each side or two after it


def packed_hidden(model: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states of one packed row. input_ids: (1, T) int64; cu_seqlens: (S+1,) int32.
    Returns (T, H) in the model's dtype."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(input_ids.device)
    longest = max(lengths)
    return decoder_of(model)(input_ids=input_ids, position_ids=positions, attention_mask=NO_MASK,
                             cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest,
                             max_length_k=longest, use_cache=False).last_hidden_state[0]


def perturb(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, segment: int, vocab: int) -> torch.Tensor:
    """``input_ids`` (1, T) with every token of ``segment`` replaced by another token id."""
    start, end = int(cu_seqlens[segment]), int(cu_seqlens[segment + 1])
    shift = 1 + torch.arange(end - start, device=input_ids.device) % (vocab - 1)  # in [1, vocab): never the same id
    out = input_ids.clone()
    out[0, start:end] = (out[0, start:end] + shift) % vocab
    return out


def leaked_segments(model: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                    segment: int) -> list[int]:
    """The segments of the row whose hidden states change, in any bit, when every token of ``segment`` does.

    input_ids: (1, T) int64; cu_seqlens: (S+1,) int32 on the model's device. Empty for a model that keeps its
    packed samples apart. Raises RuntimeError if ``segment``'s own states do not change (the test proves nothing)."""
    vocab = model.config.get_text_config().vocab_size
    before = packed_hidden(model, input_ids, cu_seqlens)
    after = packed_hidden(model, perturb(input_ids, cu_seqlens, segment, vocab), cu_seqlens)
    bounds = cu_seqlens.tolist()
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    start, end = spans[segment]
    if torch.equal(before[start:end], after[start:end]):
        raise RuntimeError(f"{type(model).__name__}: new tokens left their own hidden states unchanged")
    return [k for k, (s, e) in enumerate(spans) if k != segment and not torch.equal(before[s:e], after[s:e])]


@contextmanager
def experts_per_token(model: torch.nn.Module) -> Iterator[None]:
    """Mixture-of-experts layers computed one token at a time for the block (transformers' ``batched_mm``).

    The default grouped matmuls gather each expert's tokens into one matrix, so new tokens in one sample change
    the row count of another sample's expert products, and with it the last bits of their sums (4.8e-7 on a tiny
    Qwen3Next MoE, in a sample *before* the perturbed one: a batching effect, not a leak, since routing is per
    token). ``batched_mm`` multiplies every (token, expert) pair on its own, so only a real path between samples
    can change another sample's bits."""
    if not (hasattr(model, "set_experts_implementation") and model._can_set_experts_implementation()):
        yield
        return
    before = model.get_experts_implementation()
    model.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        model.set_experts_implementation(before)


@torch.no_grad()
def check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose packed forward lets one sample's tokens reach another's outputs.

    Installs unison's sample boundaries for hybrid layers (``unison.train.boundaries``), then runs a row of three
    samples twice, the second time with every token of one sample replaced (the middle one, then the first): the
    other samples' hidden states must come out bit-identical (``torch.equal``). Runs in the model's current mode,
    through flash and, where it is installed, cuDNN's attention (``unison.engine.cudnn_attention``) on the GPU.
    """
    impl = model.config._attn_implementation
    if impl != ATTN_NAME:
        raise ValueError(f"packed training needs attn_implementation={ATTN_NAME!r}; the model uses {impl!r}, which "
                         "would let packed samples attend to each other")
    keep_samples_apart(model)
    with experts_per_token(model):
        _check_isolation(model)
        if next(model.parameters()).is_cuda and cudnn_attention.frontend() is not None:
            with cudnn_attention.packed_rows():  # the fused training kernels' attention (step.fused_kernels)
                _check_isolation(model)


def _check_isolation(model: torch.nn.Module) -> None:
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=g).to(device)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    for segment in (1, 0):
        leaked = leaked_segments(model, ids, cu, segment)
        if leaked:
            raise RuntimeError(
                f"{type(model).__name__}'s packed forward leaks across samples: new tokens in sample {segment} of a "
                f"packed row changed the hidden states of sample(s) {leaked}. A layer of it (attention, conv, "
                "recurrent or state-space) does not take the row's boundaries (cu_seqlens); unison refuses to "
                "train it packed.")
