"""Policy logprobs of the trained tokens: one varlen decoder forward, then a chunked lm_head.

Only the M loss positions of a row go through the lm_head, and never more than ``chunk_size`` of them
at a time: full [T, vocab] fp32 logits for a 16k-token row of a 152k-vocab model would take ~10 GB,
a 1024-row chunk takes ~0.6 GB. ``chunked_logprobs``' backward recomputes each chunk's logits rather than storing
them; ``chunked_loss`` (``policy_loss``), given a loss that is a sum over tokens, takes each chunk's gradient in the
forward, while its logits exist.

The quantity is log softmax(logits / temperature) of the target token over the full vocabulary: the
same processed logprob the engine reports when top_p = 1 and top_k = 0. The logits are the model's own, head
transform included (Gemma2's softcap, Granite's logits_scaling, ...: ``unison.engine.lm_head``), with its gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from unison.engine.attention import NO_MASK
from unison.engine.cudnn_attention import packed_rows
from unison.engine.lm_head import IDENTITY, HeadTransform, decoder_of, lm_head_fp32, lm_head_of
from unison.train.boundaries import keep_samples_apart
from unison.train.loss import TokenLoss, TokenTerms
from unison.train.packing import PackedRow
from unison.vision import model as vlm
from unison.vision.inputs import Segment, language_inputs


def policy_logprobs(model: torch.nn.Module, row: PackedRow, temperature: float = 1.0, chunk_size: int = 1024,
                    with_entropy: bool = False, kernels: bool | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of ``row.targets`` at the row's loss positions (``row.loss_positions``), in order.

    ``model`` is a transformers causal LM built with ``attn_implementation="unison"``; ``row`` is on the
    model's device. Returns (logprobs: (M,) float32, differentiable w.r.t. the model's parameters;
    entropy: (M,) float32 of softmax(logits / temperature), detached, or None unless ``with_entropy``).
    ``kernels`` (None: on the GPU) runs the forward's RMSNorm, RoPE, SwiGLU and the lm_head's reductions as
    unison's fused Triton kernels (``training_kernels``); False, as transformers' modules and PyTorch's operations.
    """
    selected, head, targets, kernels = _head_inputs(model, row, kernels)
    return chunked_logprobs(selected, head.weight, targets, temperature, chunk_size, with_entropy, head.transform,
                            kernels)


def policy_loss(model: torch.nn.Module, row: PackedRow, loss_share, temperature: float = 1.0,
                chunk_size: int = 1024, with_entropy: bool = False, kernels: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``policy_logprobs`` with a token-separable loss of them, its lm_head gradient taken in the forward.

    ``loss_share(logprobs[a:b], a, b)`` is the loss of the row's loss positions a..b-1 (``unison.train.loss.
    token_loss``). Returns (loss: () float32, differentiable; logprobs: (M,) float32, detached; entropy or None).
    ``loss.backward()`` gives the parameters the gradients ``loss_share(policy_logprobs(...)[0], 0, M)`` would,
    without computing the lm_head's logits a second time (``chunked_loss``).
    """
    selected, head, targets, kernels = _head_inputs(model, row, kernels)
    return chunked_loss(selected, head.weight, targets, loss_share, temperature, chunk_size, with_entropy,
                        head.transform, kernels)


def _head_inputs(model: torch.nn.Module, row: PackedRow, kernels: bool | None):
    """The decoder's forward over the row: (hidden at the loss positions (M, H), the lm_head, the targets there (M,),
    whether the fused kernels run)."""
    if kernels is None:
        kernels = next(model.parameters()).is_cuda
    head = lm_head_of(model)
    decoder = decoder_of(model)
    keep_samples_apart(model)  # the row's boundaries reach hybrid models' conv and recurrent layers too
    inputs = {"input_ids": row.input_ids, "position_ids": row.position_ids}
    if row.images:  # a vision-language model's images at their placeholders (unison.vision.inputs)
        inputs = image_inputs(model, decoder, row)
    with training_kernels(model, kernels):
        hidden = decoder(
            **inputs,
            attention_mask=NO_MASK,
            cu_seq_lens_q=row.cu_seqlens,
            cu_seq_lens_k=row.cu_seqlens,
            max_length_q=row.max_seqlen,
            max_length_k=row.max_seqlen,
            use_cache=False,
        ).last_hidden_state  # (1, T, H)
    selected = hidden[0].index_select(0, row.loss_positions)  # (M, H)
    return selected, head, row.targets.index_select(0, row.loss_positions), kernels


@contextmanager
def training_kernels(model: torch.nn.Module, enabled: bool) -> Iterator[bool]:
    """``unison.train.fused.fused_training(model)`` and cuDNN's attention for the packed rows
    (``unison.engine.cudnn_attention.packed_rows``) if ``enabled`` (Triton imported only then), else nothing.
    Yields ``enabled``."""
    if not enabled:
        yield False
        return
    from unison.train.fused import fused_training
    with fused_training(model), packed_rows():
        yield True


def image_inputs(model: torch.nn.Module, decoder: torch.nn.Module, row: PackedRow) -> dict:
    """The decoder's inputs for a row with images: each sample's tower rows at its placeholders, its own (multimodal)
    positions from 0. A frozen tower's rows are the ones the engine prefilled with; a trained one runs again, here,
    with its gradient."""
    bounds = row.cu_seqlens.tolist()
    segments = [Segment(bounds[i], 0, bounds[i + 1] - bounds[i], images) for i, images in enumerate(row.images)]
    rows_of = (lambda p: vlm.image_features(model, p.pixels)) if vlm.vision_trains(model) else None
    return language_inputs(decoder, row.input_ids, segments, vlm.family_of(model).mrope, rows_of)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                     transform: HeadTransform = IDENTITY, kernels: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(transform(hidden @ weight.T) / temperature)[targets], ``chunk_size`` rows at a time.

    ``kernels`` (None: on the GPU) runs each chunk's reductions and its backward as one pass each
    (``unison.train.triton_logprobs``); False keeps PyTorch's operations.

    hidden: (M, H) in weight's dtype; weight: (V, H); targets: (M,) int64. Returns (logprobs: (M,)
    float32, entropy: (M,) float32 detached or None). Gradients flow to ``hidden`` and ``weight``; a
    weight tied to the input embedding accumulates both contributions in the one Parameter.
    """
    kernels = _check(temperature, chunk_size, hidden, transform, kernels)
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, targets, 1.0 / temperature, chunk_size,
                                           with_entropy, transform, kernels)
    return logp, (entropy if with_entropy else None)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss_share,
                 temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                 transform: HeadTransform = IDENTITY, kernels: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sum over chunks of ``loss_share(logprobs[a:b], a, b)``, the logprobs those of ``chunked_logprobs``, with
    each chunk's gradient taken while its logits exist: the backward recomputes nothing (``_ChunkedLoss``).

    ``loss_share`` must be separable: chunk a..b's share depends on logprobs[a:b] alone. Returns (loss: ()
    float32, differentiable w.r.t. ``hidden`` and ``weight``; logprobs: (M,) float32, detached; entropy or None).
    """
    kernels = _check(temperature, chunk_size, hidden, transform, kernels)
    loss, logp, entropy = _ChunkedLoss.apply(hidden, weight, targets, loss_share, 1.0 / temperature, chunk_size,
                                             with_entropy, transform, kernels)
    return loss, logp, (entropy if with_entropy else None)


def _check(temperature: float, chunk_size: int, hidden: torch.Tensor, transform: HeadTransform,
           kernels: bool | None) -> bool:
    """Validates the arguments; returns whether the chunk reductions run as Triton kernels."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if kernels is None:
        kernels = hidden.is_cuda
    return kernels and transform.softcap is None  # a softcap's chain rule stays PyTorch's


class _ChunkedLogprobs(torch.autograd.Function):
    """Matmul operands in the weight's dtype (bf16 on the GPU) with fp32 logits; log-sum-exp, softmax and
    grad_weight in fp32.

    Saves only hidden, weight, targets and the per-token log-sum-exp; backward recomputes the logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk_size, with_entropy, transform, kernels):
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, m, chunk_size):
            end = min(start + chunk_size, m)
            z = _scaled_logits(hidden[start:end], weight, inv_temp, transform)  # (c, V) float32
            lse[start:end], logp[start:end], chunk_entropy = _chunk_stats(z, targets[start:end], with_entropy,
                                                                          kernels)
            if with_entropy:
                entropy[start:end] = chunk_entropy
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.inv_temp, ctx.chunk_size, ctx.transform, ctx.kernels = inv_temp, chunk_size, transform, kernels
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None or not (need_h or need_w):
            return None, None, None, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if need_h else None
        # One fp32 accumulator across chunks: summing bf16 partial products would round each chunk.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            z = _scaled_logits(h, weight, ctx.inv_temp, ctx.transform)
            g = grad_logp[start:end].float()
            dlogits = _chunk_grad(z, targets[start:end], lse[start:end], g, ctx.transform, ctx.inv_temp,
                                  weight.dtype, ctx.kernels)  # (c, V)
            _add_chunk_grads(dlogits, h, weight, grad_h, grad_w, start)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None, None


class _ChunkedLoss(torch.autograd.Function):
    """``_ChunkedLogprobs`` and a separable loss of its logprobs, the gradient in the forward: each chunk's logits,
    then its logprobs, their loss share and its gradient (autograd over the share: the very gradient the loss's own
    backward would give each token), then the chunk's d logits, d hidden and d weight, and the logits freed. The
    backward scales the two gradients by its upstream one (1 for ``loss.backward()``). One lm_head matmul a chunk
    fewer than logprobs then a backward that recomputes them: a Qwen3-0.6B step of 36k tokens took 330 against
    349 ms of GPU time on an H200 (bench/results/h200/speed/loss_in_forward).
    The fp32 d weight lives from the forward to the backward, which comes right after it in a training step.
    With the Triton kernels and a ``unison.train.loss.TokenLoss`` (GRPO's losses but gspo), the chunk's d logits
    kernel takes each token's d loss / d logp itself, in closed form, and the loss is its share over the whole row
    once (``_loss_chunks``): the gradient then agrees with autograd's to fp32 rounding rather than bit for bit.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_share, inv_temp, chunk_size, with_entropy, transform, kernels):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        m = hidden.shape[0]
        logp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        out = logp, (entropy if with_entropy else None), grad_h, grad_w
        if kernels and isinstance(loss_share, TokenLoss):  # each token's gradient inside the d logits kernel
            _loss_chunks(hidden, weight, targets, loss_share.terms(), inv_temp, chunk_size, transform, *out)
            with torch.no_grad():
                loss = loss_share(logp, 0, m)
        else:
            loss = _share_chunks(hidden, weight, targets, loss_share, inv_temp, chunk_size, transform, kernels, *out)
        ctx.grads, ctx.weight_dtype = (grad_h, grad_w), weight.dtype
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        if ctx.grads is None:
            raise RuntimeError("chunked_loss: a second backward through the same loss (its gradients were handed "
                               "out, in place, by the first)")
        (grad_h, grad_w), ctx.grads = ctx.grads, None
        if grad_h is not None:
            grad_h = grad_h * grad_loss
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _share_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, loss_share, inv_temp: float,
                  chunk_size: int, transform: HeadTransform, kernels: bool, logp: torch.Tensor,
                  entropy: torch.Tensor | None, grad_h: torch.Tensor | None, grad_w: torch.Tensor | None
                  ) -> torch.Tensor:
    """``_ChunkedLoss``'s chunks with autograd's gradient of each chunk's loss share: its logits, its logprobs (into
    ``logp`` and ``entropy``), its share and that share's gradient, then d logits, d hidden and d weight. Returns the
    loss, the shares' sum."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        h = hidden[start:end]
        z = _scaled_logits(h, weight, inv_temp, transform)
        lse, logp[start:end], chunk_entropy = _chunk_stats(z, targets[start:end], entropy is not None, kernels)
        if entropy is not None:
            entropy[start:end] = chunk_entropy
        with torch.enable_grad():
            chunk_logp = logp[start:end].detach().requires_grad_(grad_h is not None or grad_w is not None)
            share = loss_share(chunk_logp, start, end)
        if share.requires_grad:  # (a share that ignores its logprobs adds nothing: grad_h starts at 0)
            (g,) = torch.autograd.grad(share, chunk_logp)
            dlogits = _chunk_grad(z, targets[start:end], lse, g, transform, inv_temp, weight.dtype, kernels)
            del z
            _add_chunk_grads(dlogits, h, weight, grad_h, grad_w, start)
        loss += share.detach()
    return loss


def _loss_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, terms: TokenTerms,
                 inv_temp: float, chunk_size: int, transform: HeadTransform, logp: torch.Tensor,
                 entropy: torch.Tensor | None, grad_h: torch.Tensor | None, grad_w: torch.Tensor | None) -> None:
    """``_ChunkedLoss``'s chunks through the Triton kernels with the loss's gradient in closed form: a chunk's logits,
    one kernel for its logprobs (written into ``logp`` and ``entropy``), one for its d logits with each token's
    d loss / d logp taken inside it from ``terms``, then d hidden and d weight: five launches a chunk, where the
    share and autograd's gradient of it took ~48 more (bench/train_launches.py)."""
    from unison.train import triton_logprobs

    if grad_h is None and grad_w is None:  # nothing trains through the head: the logprobs alone
        terms = None
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        h = hidden[start:end]
        z = _scaled_logits(h, weight, inv_temp, transform)
        lse, chunk_logp, _ = triton_logprobs.chunk_forward(z, targets[start:end], entropy is not None,
                                                           logp=logp[start:end],
                                                           entropy=entropy[start:end] if entropy is not None else None)
        if terms is not None:
            dlogits = triton_logprobs.chunk_loss_backward(z, targets[start:end], lse, chunk_logp, terms, start,
                                                          transform.scale * inv_temp, weight.dtype)
            del z
            _add_chunk_grads(dlogits, h, weight, grad_h, grad_w, start)


def _add_chunk_grads(dlogits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, grad_h: torch.Tensor | None,
                     grad_w: torch.Tensor | None, start: int) -> None:
    """A chunk's d hidden into rows start.. of ``grad_h``, its d weight added to the fp32 ``grad_w`` (either None:
    not needed). dlogits: (c, V) d loss / d raw logits of the chunk whose hidden states are h: (c, H)."""
    if grad_h is not None:
        rows = grad_h[start:start + dlogits.shape[0]]
        if rows.is_contiguous() and rows.dtype == dlogits.dtype:  # written in place, no copy of the product
            torch.mm(dlogits, weight, out=rows)
        else:
            rows.copy_(dlogits @ weight)
    if grad_w is not None:
        _accumulate_weight_grad(grad_w, dlogits.T, h)


_MM_INTO_FP32 = any("dtype_out" in str(s) for s in torch._C._jit_get_schemas_for_operator("aten::addmm"))


def _accumulate_weight_grad(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for bf16/fp16 a, b: on the GPU one GEMM with fp32 output accumulating into acc in place
    (torch's ``out_dtype``), where the product rounded to bf16, then cast, then added made three more passes over a
    vocabulary-sized tensor per chunk (the add alone 13.7 ms of a Qwen3-0.6B step on the H200) and rounded each
    chunk's product to bf16."""
    if acc.is_cuda and _MM_INTO_FP32 and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


def _chunk_stats(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool, kernels: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """z: (c, V) float32 scaled logits. Returns (lse, logp of the targets, entropy or None), each (c,) float32."""
    if kernels:
        from unison.train import triton_logprobs
        return triton_logprobs.chunk_forward(z, targets, with_entropy)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lse, logp, None
    log_probs = z - lse[:, None]  # not lse - sum(p * z): that cancels at large logits
    return lse, logp, -(log_probs.exp() * log_probs).sum(-1)


def _chunk_grad(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, transform: HeadTransform,
                inv_temp: float, dtype: torch.dtype, kernels: bool) -> torch.Tensor:
    """d loss / d x for the raw logits x of a chunk, in ``dtype``: d logp / d z = onehot(target) - softmax(z), and the
    transform's chain rule, the 1/T included, takes it back to x (z is consumed under a softcap)."""
    if kernels:  # no softcap: the chain rule is the one factor scale / T
        from unison.train import triton_logprobs
        return triton_logprobs.chunk_backward(z, targets, lse, g.contiguous(), transform.scale * inv_temp, dtype)
    dz = torch.exp(z - lse[:, None]).mul_(-g[:, None])
    dz.scatter_add_(1, targets[:, None], g[:, None])
    return transform.backward_(dz, z, inv_temp).to(dtype)


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, inv_temp: float,
                   transform: HeadTransform) -> torch.Tensor:
    """hidden: (c, H); weight: (V, H). Returns (c, V) float32 transform(logits) / temperature."""
    return transform.apply_(lm_head_fp32(hidden, weight), inv_temp)


def full_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            temperature: float = 1.0, transform: HeadTransform = IDENTITY
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain full-logits computation ``chunked_logprobs`` must equal (for tests; O(M x V) memory), its
    gradient by autograd.

    hidden: (M, H); weight: (V, H); targets: (M,) int64. Returns (logprobs: (M,) float32, entropy: (M,)
    float32), both differentiable.
    """
    logits = lm_head_fp32(hidden, weight) * transform.scale
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    logp = log_probs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy
