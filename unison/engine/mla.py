"""Multi-head latent attention from a latent KV cache, the up-projections absorbed (DeepSeek-V2/V3 and the MLA
families transformers has: GLM-4.7-Flash, Youtu, LongCat-Flash).

An MLA layer compresses each token into a latent ``c`` (``kv_lora_rank`` wide, normalised) and a rotated key
``k_rot`` (``qk_rope_head_dim`` wide) shared by all heads, and expands them per head with ``kv_b_proj``:
``k_h = [W_UK_h c, k_rot]``, ``v_h = W_UV_h c``. Caching the expansion costs ``heads * (qk_nope + qk_rope +
v_head_dim)`` elements per token and layer; caching ``[c, k_rot]`` costs ``kv_lora_rank + qk_rope_head_dim``
(DeepSeek-V2-Lite: 5120 against 576, 8.9x less). Attention is then computed without expanding anything,
by associativity:

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rot_h . k_rot        (the query moves into latent space)
    sum_j p_hj v_hj = W_UV_h (sum_j p_hj c_j)                    (the output leaves it after the softmax)

so every head attends to the same single "KV head" ``[c, k_rot]`` with values ``c``: multi-query attention with
keys ``kv_lora_rank + qk_rope_head_dim`` wide and values ``kv_lora_rank`` wide, which the paged backends run
like any other layer (the Triton backend with a kernel that reads each latent once for both,
``unison.engine.triton_mla``). The same function in exact arithmetic; in floating point the query and the
output are rounded in latent space instead of the keys and values per head.

The seam is transformers' own: each MLA attention module hands its latent to ``cache.update(c, k_rot,
layer_idx)`` before expanding it. The engine passes a ``LatentCache`` that writes them into the paged pool;
the attention function then ignores the expanded keys and values it receives and calls ``attend_absorbed``.
Packed training and plain forwards are untouched (no cache: the module expands as usual).
"""

from __future__ import annotations

import torch

from .attention_ops import varlen_attention, varlen_supported

_NEEDS = ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "expand_kv")


class LatentCache:
    """What an engine forward passes as ``cache=``: MLA modules write their latents through ``update``."""

    def __init__(self, batch):
        self.batch = batch  # unison.engine.backend.PagedBatch

    def update(self, latent: torch.Tensor, k_rot: torch.Tensor, layer_idx: int, *args, **kwargs):
        """latent: (1, 1, N, kv_lora_rank); k_rot: (1, 1, N, qk_rope_head_dim), of this step's tokens. Written to
        the pool; returned unchanged (the module expands only these, and the attention function ignores that)."""
        pool = self.batch.pool
        if not pool.layers[layer_idx].value_in_key:
            raise RuntimeError(f"layer {layer_idx} wrote a latent KV but its pool holds expanded keys and values")
        kv, slots, rank = pool.k[layer_idx], self.batch.slot_mapping, latent.shape[-1]
        kv[..., :rank].index_copy_(0, slots, latent[0].transpose(0, 1).to(kv.dtype))
        kv[..., rank:].index_copy_(0, slots, k_rot[0].transpose(0, 1).to(kv.dtype))
        return latent, k_rot


def forward_kwargs(batch) -> dict:
    """Extra keyword arguments of an engine forward over ``batch``: the latent cache where the pool holds one."""
    return {"cache": LatentCache(batch)} if batch.pool.has_latent else {}


def check_module(module: torch.nn.Module) -> None:
    """Refuse an MLA attention module the absorbed path cannot run exactly (``engine.mla_cache=expanded`` can)."""
    missing = [name for name in _NEEDS if not hasattr(module, name)]
    if missing:
        raise ValueError(f"{type(module).__name__}: a latent KV cache needs the MLA attributes {missing}; set "
                         f"engine.mla_cache=expanded")
    if getattr(module.kv_b_proj, "bias", None) is not None:
        raise ValueError(f"{type(module).__name__}: kv_b_proj has a bias, which the absorbed up-projection does not "
                         f"carry; set engine.mla_cache=expanded")


def attend_absorbed(batch, module: torch.nn.Module, q: torch.Tensor, scale: float, window: int | None,
                    sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """q: (N, H, qk_nope + qk_rope) after RoPE (this rank's heads). Returns (N, H, v_head_dim).

    With the Triton backend and flash varlen, a step's multi-token chunks (prefill) expand their contexts'
    latents instead, as the model's own ``expand_kv`` does, and run flash over them: a chunk's query count makes
    the absorbed form's wide (``kv_lora_rank + qk_rope``) keys the expensive side there, and flash cannot take
    them. Decode rows always attend absorbed."""
    layer = module.layer_idx
    layers = dict(window=window, sinks=sinks, softcap=softcap)
    k_pool, v_pool = batch.pool.k[layer], batch.pool.v[layer]
    w_uk, w_uv = _up_projections(module, q.shape[1])
    state = batch.state
    if getattr(state, "chunk_rows", None) is None or not varlen_supported(q, q, q, softcap):
        return _absorbed(batch.backend.attend, state, k_pool, v_pool, q, w_uk, w_uv, scale, layers)
    out = q.new_empty(*q.shape[:-1], w_uv.shape[1])
    if state.block_tables is not None:
        rows = state.decode_rows
        out.index_copy_(0, rows, _absorbed(batch.backend.decode, state, k_pool, v_pool, q.index_select(0, rows),
                                           w_uk, w_uv, scale, layers))
    rows, latent = state.chunk_rows, k_pool.index_select(0, state.chunk_slots)[:, 0]  # (Lc, R + E)
    rank = module.kv_lora_rank
    kv = torch.einsum("lr,hdr->lhd", latent[:, :rank], torch.cat([w_uk, w_uv], dim=1))  # (Lc, H, nope + Dv)
    nope = w_uk.shape[1]
    k = torch.cat([kv[..., :nope], latent[:, None, rank:].expand(-1, q.shape[1], -1)], dim=-1)
    o = varlen_attention(q.index_select(0, rows), k, kv[..., nope:], state.cu_q, state.cu_k, state.max_q,
                         state.max_k, scale, window, sinks)
    out.index_copy_(0, rows, o)
    return out


def _up_projections(module: torch.nn.Module, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj``'s weight as (H, qk_nope, R) key and (H, Dv, R) value up-projections of this rank's heads (with
    LoRA adapters on it, their product added: the absorbed form needs the one matrix)."""
    weight = _effective_weight(module.kv_b_proj)
    if hasattr(weight, "to_local"):  # a tensor-parallel shard: this rank's heads
        weight = weight.to_local()
    nope = module.qk_nope_head_dim
    w = weight.view(heads, nope + module.v_head_dim, module.kv_lora_rank)
    return w[:, :nope], w[:, nope:]


def _effective_weight(proj: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight; for a PEFT LoRA layer with its adapters on, ``W + scaling * B @ A`` (in fp32)."""
    if not hasattr(proj, "lora_A"):
        return proj.weight
    weight = proj.get_base_layer().weight
    active = [a for a in proj.active_adapters if a in proj.lora_A]
    if proj.disable_adapters or proj.merged or not active:
        return weight
    delta = sum(proj.lora_B[a].weight.float() @ proj.lora_A[a].weight.float() * proj.scaling[a] for a in active)
    return (weight.float() + delta).to(weight.dtype)


def _absorbed(attend, state, k_pool, v_pool, q, w_uk, w_uv, scale, layers) -> torch.Tensor:
    nope = w_uk.shape[1]
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # (N, H, R)
    q_abs = torch.cat([q_latent, q[..., nope:]], dim=-1)
    out_latent = attend(state, k_pool, v_pool, q_abs, scale, **layers)  # (N, H, R)
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (N, H, Dv)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MLA attention modules (those with a ``kv_b_proj``)."""
    return [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "layer_idx")]
