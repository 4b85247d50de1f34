"""The engine's decoder layers with fewer launches: each residual add joined to the norm after it, and q/k norms,
RoPE and the K/V write into the pool as one kernel.

A decode step of a small model is a chain of short kernels (bench/results/h200/speed/decode: 14 a layer at the
Qwen3-0.6B shape, ~1.3-2.5 us each at 64 rows). transformers' decoder layer adds the residual in one kernel and
normalises the sum in the next; its attention normalises q and k (Qwen3) in two, rotates them in a third, and the
attention function writes K and V into the pool in a fourth. ``fused_layers(decoder)`` swaps, for a ``with`` block
(the engine runs its forwards inside it), the forward of

- every decoder layer whose forward is Llama's statement for statement (``LAYER_BODY``: Llama, Qwen2, Qwen3,
  Mistral, Qwen3-MoE, GLM-4-MoE, DeepSeek-V3, SmolLM3 in transformers 5.25) and whose two norms the norm kernel
  computes (``fused_norm.fusable``): the residual add after attention runs in the post-attention norm's kernel, the
  add after the MLP in the next layer's input norm (or the model's final norm), found by identity: the layer
  returns the sum and leaves the normalised sum for the norm that receives that very tensor; any other consumer
  (a vision-language model's deepstack add in between, say) gets a norm of its own;
- every attention of a known class (``fused_rope.ATTENTION_CLASSES``) whose forward is one of the Llama-family
  forms (``attention_form``: q/k norms or not, a sliding window or not), with plain ``nn.Linear`` projections of the
  pool's dtype, on the engine's paged forwards: ``qkv_rope_write`` normalises and rotates q and k, writes k and v
  at the tokens' pool slots and returns q; ``PagedBatch.attend_written`` then attends over the pool as
  ``PagedBatch.attend`` does after its own write. o_proj and down_proj leave their split-K shares unsummed for the
  residual add + norm kernel after them (``fused_linear.partials``).

Each kernel rounds where transformers rounds (the sum to the dtype, the normalised value, the weight's product,
each RoPE product and their sum), so the fused layer computes the layer's function (tests/test_fused_layer.py).
Anything else (another dtype or device, a latent MLA pool, tensor-parallel shards, LoRA) runs transformers'
forward. On the CPU the kernels would run in Triton's interpreter, where they cost more than they save: the swap
is for ``DEVICES`` only (tests add "cpu").
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager

import torch
import triton
import triton.language as tl

from . import gdc
from .fused_linear import partials, plain_weight, swap_forward
from .fused_norm import add_rms_norm, fusable
from .fused_rope import ATTENTION_CLASSES
from .source import body

DEVICES = {"cuda"}

LAYER_BODY = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    "hidden_states, _ = self.self_attn(",
    "hidden_states=hidden_states,", "attention_mask=attention_mask,", "position_ids=position_ids,", "cache=cache,",
    "use_cache=use_cache,", "position_embeddings=position_embeddings,", "**kwargs,", ")",
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states")

_QKV = ("query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)")
_QKV_NORMED = ("query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
               "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)")
_WINDOWS = {None: (), "layer": ("sliding_window=self.sliding_window,",),
            "config": ('sliding_window=getattr(self.config, "sliding_window", None),',)}


def _attention_body(qk_norm: bool, window: str | None) -> tuple[str, ...]:
    return (
        "input_shape = hidden_states.shape[:-1]",
        "hidden_shape = (*input_shape, -1, self.head_dim)",
        *(_QKV_NORMED if qk_norm else _QKV),
        "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "cos, sin = position_embeddings",
        "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
        "if cache is not None:",
        "key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)",
        "attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(",
        "self.config._attn_implementation, eager_attention_forward", ")",
        "attn_output, attn_weights = attention_interface(",
        "self,", "query_states,", "key_states,", "value_states,", "attention_mask,",
        "dropout=0.0 if not self.training else self.attention_dropout,",
        "scaling=self.scaling,", *_WINDOWS[window], "**kwargs,", ")",
        "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
        "attn_output = self.o_proj(attn_output)",
        "return attn_output, attn_weights")


@functools.cache
def attention_form(cls: type) -> tuple[bool, str | None] | None:
    """(q/k norms, where the sliding window comes from) of a known attention class whose forward is one of the
    Llama-family forms, else None."""
    if cls.__name__ not in ATTENTION_CLASSES:
        return None
    found = body(cls.forward)
    return next(((qk, w) for qk in (False, True) for w in _WINDOWS if found == _attention_body(qk, w)), None)


@functools.cache
def llama_layer(cls: type) -> bool:
    return body(cls.forward) == LAYER_BODY


@triton.jit
def normed_rope(Q, K, QW, KW, Cos, Sin, t, heads, q_heads, k_heads, stride_q, stride_k, stride_c, eps_q, eps_k,
                HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    """Token t's ``heads`` (query heads, then key heads, each 2 * HALF wide at Q + t * stride_q, K + t * stride_k)
    normalised (unless not NORM) and rotated with transformers' roundings; returns (out, d, dmask, is_q, is_k, kh):
    the rows, their columns and which rows are which (kh: the key head of each row). The engine's
    ``qkv_rope_write`` and the trainer's ``unison.train.fused_qk`` both compute it, so their q and k agree bit for bit
    (launched with multiply-add contraction off)."""
    head = heads[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    dmask = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    is_q = head < q_heads
    is_k = (head >= q_heads) & (head < q_heads + k_heads)
    kh = (head - q_heads).to(tl.int64)
    q_at = Q + t * stride_q + head * (2 * HALF)
    k_at = K + t * stride_k + kh * (2 * HALF)
    x = tl.where(is_q, tl.load(q_at + d, mask=dmask & is_q, other=0.0),
                 tl.load(k_at + d, mask=dmask & is_k, other=0.0))
    other = tl.where(is_q, tl.load(q_at + partner, mask=dmask & is_q, other=0.0),
                     tl.load(k_at + partner, mask=dmask & is_k, other=0.0))
    dtype = x.dtype
    if NORM:  # the head's RMSNorm, as fused_norm's kernel: fp32 statistics, the normalised value rounded, times w
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, 1) / (2 * HALF) + tl.where(heads < q_heads, eps_q, eps_k))[:, None]
        w = tl.where(is_q, tl.load(QW + d, mask=dmask, other=0.0), tl.load(KW + d, mask=dmask, other=0.0))
        wp = tl.where(is_q, tl.load(QW + partner, mask=dmask, other=0.0),
                      tl.load(KW + partner, mask=dmask, other=0.0))
        x = (w.to(tl.float32) * (xf * r).to(dtype).to(tl.float32)).to(dtype)
        other = (wp.to(tl.float32) * (other.to(tl.float32) * r).to(dtype).to(tl.float32)).to(dtype)
    cos = tl.load(Cos + t * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    rotated = tl.where(first, -other.to(tl.float32), other.to(tl.float32))  # rotate_half: cat(-x2, x1)
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)  # transformers' roundings: each product, then the sum
    b = (rotated * sin).to(dtype).to(tl.float32)
    return (a + b).to(dtype), d, dmask, is_q, is_k, kh


# One program: HEADS of one token's heads (its query heads, then its key heads, each key head with its value head).
@triton.jit
def _qkv_rope_write_kernel(Q, K, V, QW, KW, Cos, Sin, QO, KP, VP, Slots, q_heads, k_heads, stride_q, stride_k,
                           stride_v, stride_c, stride_qo, stride_kp, stride_vp, eps_q, eps_k, HALF: tl.constexpr,
                           BLOCK: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    gdc.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    out, d, dmask, is_q, is_k, kh = normed_rope(Q, K, QW, KW, Cos, Sin, t, heads, q_heads, k_heads, stride_q,
                                                stride_k, stride_c, eps_q, eps_k, HALF, BLOCK, NORM)
    store_rotated(out, d, dmask, is_q, is_k, kh, heads, t, V, QO, KP, VP, Slots, stride_v, stride_qo, stride_kp,
                  stride_vp, HALF)


@triton.jit
def store_rotated(out, d, dmask, is_q, is_k, kh, heads, t, V, QO, KP, VP, Slots, stride_v, stride_qo, stride_kp,
                  stride_vp, HALF: tl.constexpr):
    """``normed_rope``'s rows of token t stored: the query rows (``is_q``) at QO, the key rows (``is_k``) and the
    token's value rows of the same heads (from V) at its pool slot."""
    tl.store(QO + t * stride_qo + heads[:, None] * (2 * HALF) + d, out, mask=dmask & is_q)
    kv = dmask & is_k
    slot = tl.load(Slots + t)
    tl.store(KP + slot * stride_kp + kh * (2 * HALF) + d, out, mask=kv)
    v = tl.load(V + t * stride_v + kh * (2 * HALF) + d, mask=kv, other=0.0)
    tl.store(VP + slot * stride_vp + kh * (2 * HALF) + d, v, mask=kv)


def qkv_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                   q_norm: torch.nn.Module | None = None, k_norm: torch.nn.Module | None = None,
                   heads_per_program: int = 8) -> torch.Tensor:
    """q: (N, H, D), k and v: (N, KVH, D), each row's heads contiguous; cos, sin: (N, D); pools (slots, KVH, D)
    contiguous; slots: (N,) int64. Writes rope(k_norm(k)) and v into the pools at ``slots`` and returns
    rope(q_norm(q)) as (N, H, D) (without norms: RoPE alone)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    norm = q_norm is not None
    qw = q_norm.weight if norm else q
    kw = k_norm.weight if norm else q
    per, warps = rope_tile(heads, kv_heads, dim, heads_per_program)
    _qkv_rope_write_kernel[(n, triton.cdiv(heads + kv_heads, per))](
        q, k, v, qw, kw, cos, sin, q_out, k_pool, v_pool, slots, heads, kv_heads, q.stride(0), k.stride(0),
        v.stride(0), cos.stride(0), q_out.stride(0), k_pool.stride(0), v_pool.stride(0),
        q_norm.variance_epsilon if norm else 0.0, k_norm.variance_epsilon if norm else 0.0, HALF=dim // 2,
        BLOCK=triton.next_power_of_2(dim), HEADS=per, NORM=norm, num_warps=warps,
        enable_fp_fusion=False, **gdc.launch(q))
    return q_out


def rope_tile(heads: int, kv_heads: int, dim: int, heads_per_program: int = 8) -> tuple[int, int]:
    """``qkv_rope_write``'s program: how many heads (rows) it normalises and rotates, and its warps. A q/k norm's
    sum of squares is reduced in an order that the tile's shape and warps decide (Triton's layout for them), so
    another kernel that must round as this one does (``unison.engine.rope_decode``) takes the same tile."""
    per = min(triton.next_power_of_2(heads + kv_heads), heads_per_program)
    return per, 1 if per * dim <= 512 else 4


class _Chain:
    """The normalised sum a layer computed for the norm after it, keyed by the sum tensor itself."""

    def __init__(self):
        self.total = self.norm = self.normed = None

    def put(self, total: torch.Tensor, norm: torch.nn.Module, normed: torch.Tensor) -> None:
        self.total, self.norm, self.normed = total, norm, normed

    def take(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor | None:
        hit = x is self.total and norm is self.norm
        normed = self.normed if hit else None
        self.total = self.norm = self.normed = None
        return normed


def _layer_forward(layer: torch.nn.Module, chain: _Chain, next_norm: torch.nn.Module | None, add_norm, call):
    original = layer.forward
    post = layer.post_attention_layernorm

    def forward(hidden_states, *args, **kwargs):
        if args or (layer.training and getattr(layer, "gradient_checkpointing", False)):
            chain.take(hidden_states, None)  # (a recomputed forward must save what its first run saved)
            return original(hidden_states, *args, **kwargs)
        normed = chain.take(hidden_states, layer.input_layernorm)
        if normed is None:
            normed = layer.input_layernorm(hidden_states)
        attended, _ = call(layer.self_attn, hidden_states=normed, **kwargs)
        residual, normed = add_norm(attended, hidden_states, post.weight, post.variance_epsilon)
        if next_norm is None:
            return residual + layer.mlp(normed)
        out = call(layer.mlp, normed)
        total, normed = add_norm(out, residual, next_norm.weight, next_norm.variance_epsilon)
        chain.put(total, next_norm, normed)
        return total
    forward.chain = chain  # (emptied where the swaps end: unison.engine.swaps)
    return forward


def _norm_forward(norm: torch.nn.Module, chain: _Chain):
    original = norm.forward

    def forward(hidden_states):
        normed = chain.take(hidden_states, norm)
        return normed if normed is not None else original(hidden_states)
    return forward


def _attention_forward(attn: torch.nn.Module, qk_norm: bool, window: str | None):
    original = attn.forward
    sliding = attn.sliding_window if window == "layer" else \
        getattr(attn.config, "sliding_window", None) if window == "config" else None

    def forward(hidden_states, *args, output=None, **kwargs):
        paged = kwargs.get("paged")
        cos, sin = kwargs.get("position_embeddings") or (None, None)
        layer = attn.layer_idx
        if (args or paged is None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
                or cos is None or not _covered(hidden_states, cos, sin, paged.pool, layer, attn.head_dim)):
            return original(hidden_states, *args, **kwargs)
        n = hidden_states.shape[1]
        q = attn.q_proj(hidden_states).view(n, -1, attn.head_dim)
        k = attn.k_proj(hidden_states).view(n, -1, attn.head_dim)
        v = attn.v_proj(hidden_states).view(n, -1, attn.head_dim)
        k_pool, v_pool = paged.pools(layer, k, v)
        q_norm, k_norm = (attn.q_norm, attn.k_norm) if qk_norm else (None, None)
        out = paged.attend_rope(layer, q, k, v, cos[0], sin[0], q_norm, k_norm, attn.scaling, sliding)
        if out is None:  # not a step the backend's one launch takes
            q = qkv_rope_write(q, k, v, cos[0], sin[0], k_pool, v_pool, paged.slot_mapping, q_norm, k_norm)
            out = paged.attend_written(layer, q, attn.scaling, sliding)
        out = out.reshape(1, n, -1)
        return (output(attn.o_proj, out) if output is not None else attn.o_proj(out)), None
    forward.partials = functools.partial(forward, output=partials)
    return forward


def _covered(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool, layer: int, head_dim: int) -> bool:
    """An engine forward (batch 1), full-width RoPE tables of x's dtype, a plain K/V pool of that dtype (not an MLA
    latent)."""
    k_pool, v_pool = pool.k[layer], pool.v[layer]
    return (x.ndim == 3 and x.shape[0] == 1 and not pool.layers[layer].value_in_key
            and cos.shape == (1, x.shape[1], head_dim) and sin.shape == cos.shape and sin.stride() == cos.stride()
            and cos.stride(-1) == 1 and cos.dtype == sin.dtype == k_pool.dtype == v_pool.dtype == x.dtype
            and k_pool.is_contiguous() and v_pool.is_contiguous())


@contextmanager
def fused_layers(decoder: torch.nn.Module):
    """Within the block, the Llama-form decoder layers and attentions of ``decoder`` (a model's decoder stack with
    ``layers`` and a final ``norm``) run with the fused adds and the fused q/k norm, RoPE and K/V write. Enter it
    inside ``fused_norms`` (its norms are then the fused ones). Yields the number of modules switched."""
    with ExitStack() as stack:
        switched = 0
        layers = list(getattr(decoder, "layers", []))
        param = next(decoder.parameters(), None)
        if param is None or param.device.type not in DEVICES:
            yield 0
            return
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            form = attention_form(type(attn)) if attn is not None else None
            if form is not None and _attention_fusable(attn, form[0]):
                swap_forward(stack, attn, _attention_forward(attn, *form))
                switched += 1
        yield switched + fused_adds(stack, decoder)


def fused_adds(stack: ExitStack, decoder: torch.nn.Module, add_norm=None, call=None) -> int:
    """Swaps, until ``stack`` closes, the forward of every Llama-form decoder layer of ``decoder`` whose norms the
    kernel computes for one that adds each residual in the norm after it: ``add_norm(x, residual, weight, eps)``
    gives (sum, norm of the sum), ``call(module, ...)`` runs the attention and the MLP (the engine's: split-K shares
    left unsummed; the trainer passes its differentiable ``unison.train.fused.add_rms_norm`` and a plain call).
    A layer under activation checkpointing runs its own forward. Returns the number of layers switched."""
    add_norm, call = add_norm or add_rms_norm, call or partials
    layers = list(getattr(decoder, "layers", []))
    fused = [llama_layer(type(layer)) and fusable(layer.input_layernorm)
             and fusable(layer.post_attention_layernorm) for layer in layers]
    final = getattr(decoder, "norm", None)
    final = final if isinstance(final, torch.nn.Module) and fusable(final) else None
    chain = _Chain()
    stack.callback(chain.take, None, None)  # drop what a failed forward left behind
    for i, layer in enumerate(layers):
        if fused[i]:
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) and fused[i + 1] else \
                final if i + 1 == len(layers) else None
            swap_forward(stack, layer, _layer_forward(layer, chain, after, add_norm, call))
    if final is not None and layers and fused[-1]:
        swap_forward(stack, final, _norm_forward(final, chain))
    return sum(fused)


def _attention_fusable(attn: torch.nn.Module, qk_norm: bool) -> bool:
    """Plain ``nn.Linear`` projections of one dtype, no sinks, norms the kernel computes."""
    linears = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    weights = [plain_weight(m) if type(m) is torch.nn.Linear else None for m in linears]
    if any(w is None for w in weights):
        return False
    dtypes = {w.dtype for w in weights}
    if qk_norm:
        if not (fusable(attn.q_norm) and fusable(attn.k_norm)):
            return False
        dtypes |= {attn.q_norm.weight.dtype, attn.k_norm.weight.dtype}  # the kernel rounds the norm to q's dtype
    return len(dtypes) == 1 and getattr(attn, "sinks", None) is None
