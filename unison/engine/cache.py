"""The engine's KV memory: one pool of blocks for all layers, a ref-counted allocator, a prefix cache."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import vmm

# ``layer_types`` of layers without attention (Qwen3-Next / Qwen3.5 gated delta-nets, Lfm2 short convs).
STATE_LAYER_TYPES = ("linear_attention", "conv", "mamba")


@dataclass(frozen=True)
class LayerKV:
    """What one attention layer caches per token on this rank: ``kv_heads`` keys ``key_dim`` wide and as many
    values ``value_dim`` wide. ``value_in_key``: the values are the keys' first ``value_dim`` columns and take no
    memory of their own (the latent cache of multi-head latent attention, ``unison.engine.mla``)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    value_in_key: bool = False

    @property
    def width(self) -> int:
        """Elements per token and KV head held in the pool."""
        return self.key_dim + (0 if self.value_in_key else self.value_dim)


def kv_widths(text_config, tp: int = 1, mla_cache: str = "latent") -> list[LayerKV]:
    """Each layer's cache shape for a transformers text config, under tensor parallelism of size ``tp``.

    Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Youtu; configs with ``kv_lora_rank``) caches,
    with ``mla_cache="latent"``, one compressed latent per token: ``kv_lora_rank`` normalised latent columns and
    ``qk_rope_head_dim`` rotated key columns, shared by all heads (one "KV head"), the values being the latent
    itself; attention then runs with the up-projections absorbed into the query and the output
    (``unison.engine.mla``). With ``"expanded"`` it caches what the attention function receives:
    ``num_attention_heads`` keys ``qk_nope_head_dim + qk_rope_head_dim`` wide and values ``v_head_dim`` wide.
    """
    c = text_config
    heads = c.num_attention_heads
    if getattr(c, "index_topk", None):
        raise ValueError(f"{c.model_type}: sparse attention (a lightning indexer keeping the top {c.index_topk} "
                         f"keys per query, DeepSeek-V3.2 / GLM-5 style) is not implemented by unison's engine or "
                         f"its packed training; dense attention over every key would be silently wrong past "
                         f"{c.index_topk} tokens")
    if getattr(c, "kv_lora_rank", None) and getattr(c, "v_head_dim", None):
        if mla_cache == "latent":
            if heads % tp:
                raise ValueError(f"{c.model_type}: {heads} attention heads do not split across tensor-parallel "
                                 f"size {tp}")
            return [LayerKV(1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, value_in_key=True)
                    ] * c.num_hidden_layers
        kv_heads, key_dim, value_dim = heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    else:
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        key_dim = value_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if kv_heads % tp:
        raise ValueError(f"{c.model_type}: {kv_heads} KV heads do not split across tensor-parallel size {tp}")
    # Hybrid models: their linear-attention and conv layers keep a fixed-size state instead (unison.engine.state).
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    return [LayerKV(0 if kind in STATE_LAYER_TYPES else kv_heads // tp, key_dim, value_dim) for kind in types]



class KVPool(vmm.LendsMemory):
    """K and V for every layer: ``k[layer]`` is ``(num_blocks * block_size, KVH, Dk)``, ``v[layer]``
    ``(num_blocks * block_size, KVH, Dv)`` (a view of ``k[layer]``'s first columns where the layer's values are
    in its keys), each layer's shapes from its ``LayerKV``; all are views of one allocation, which ``release()``
    gives back to the device and ``restore()`` takes again (contents lost).

    On CUDA with ``cuda-bindings`` the allocation is virtual memory at a fixed address, so views and CUDA graphs
    captured on them stay valid across a release; elsewhere the storage is resized to nothing and back, and
    ``restore()`` reports that addresses moved (captured graphs must be recaptured).
    """

    def __init__(self, num_blocks: int, block_size: int, layers: list[LayerKV], dtype: torch.dtype,
                 device: torch.device):
        self.num_slots = n = num_blocks * block_size
        self.layers = list(layers)
        numel = sum(n * layer.kv_heads * layer.width for layer in self.layers)
        self._memory = vmm.LendableBuffer(numel, dtype, device)
        self.storage = self._memory.storage
        self.k, self.v = [], []
        offset = 0
        for layer in self.layers:
            for views, width in ((self.k, layer.key_dim), (self.v, 0 if layer.value_in_key else layer.value_dim)):
                size = n * layer.kv_heads * width
                views.append(self.storage[offset:offset + size].view(n, layer.kv_heads, width))
                offset += size
            if layer.value_in_key:
                self.v[-1] = self.k[-1][..., :layer.value_dim]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V at slots ``src`` into slots ``dst`` (int64, same length, disjoint)."""
        for layer, k, v in zip(self.layers, self.k, self.v, strict=True):
            if layer.kv_heads == 0:  # a hybrid model's linear-attention layer: no KV
                continue
            k.index_copy_(0, dst, k.index_select(0, src))
            if not layer.value_in_key:
                v.index_copy_(0, dst, v.index_select(0, src))

    @property
    def has_latent(self) -> bool:
        """Whether some layer caches an MLA latent (``unison.engine.mla``)."""
        return any(layer.value_in_key for layer in self.layers)


class BlockAllocator:
    """Blocks with reference counts, plus a prefix cache of full prompt blocks keyed by a chained hash.

    A block with refcount 0 sits in the free queue (oldest first). If it still holds a cached prefix it stays
    findable until the allocator hands it out again (LRU eviction). A cached block is *pending* from the time a
    request allocates it until its KV is computed; only computed blocks are served to other requests.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_of: dict[int, int] = {}  # prefix hash -> block
        self.hash_of: dict[int, int] = {}  # block -> prefix hash
        self.computed: set[int] = set()  # cached blocks whose KV is written

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.refcount[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block not in self.computed:
                    self._forget(block)  # a pending prefix whose owner went away: nobody will compute it
                self.free[block] = None

    def acquire(self, block: int) -> None:
        if self.refcount[block] == 0:
            del self.free[block]
        self.refcount[block] += 1

    def lookup(self, hashes: list[int]) -> tuple[list[int], bool]:
        """The longest run of computed cached blocks for these prefix hashes, and whether the first block not
        served is pending (being computed by another request right now)."""
        hits = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                return hits, False
            if block not in self.computed:
                return hits, True
            hits.append(block)
        return hits, False

    def register(self, block: int, h: int) -> None:
        """Make ``block`` the pending cache entry for prefix hash ``h`` (unless another block has it)."""
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h] = block
            self.hash_of[block] = h

    def mark_computed(self, block: int) -> None:
        if block in self.hash_of:
            self.computed.add(block)

    def clear_cache(self) -> None:
        """Forget every cached prefix (their KV belongs to old weights); blocks in use stay with their owners."""
        self.block_of.clear()
        self.hash_of.clear()
        self.computed.clear()

    def _forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
        self.computed.discard(block)


def prefix_hashes(tokens: list[int], block_size: int, num_blocks: int, salt: bytes = b"",
                  salt_from: int = 0) -> list[int]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``tokens``: equal hashes mean equal prefixes.
    ``salt`` (a prompt's image content) enters the chain at the block holding token ``salt_from`` (its first image
    placeholder): the blocks before it are shared with any prompt of the same text, none from there on with a prompt
    of other images."""
    hashes, parent = [], b""
    for i in range(num_blocks):
        if salt and i == salt_from // block_size:
            parent = hashlib.blake2b(parent + salt, digest_size=16).digest()
        # 128-bit digests: a collision would silently serve another prompt's KV.
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes
