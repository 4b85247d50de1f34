"""The trainer's Triton kernels compile for the GPUs users train on, checked on a machine without one: each variant
a bf16 training row launches in the CPU tests' interpreter (weights joined as ``load_policy`` lays them out, and
apart), compiled by Triton's compiler for the H200 (sm_90)
and the A100 (sm_80) (``kernel_specs``); and the engine's decode attention, MoE experts and latent (MLA) decode
kernels likewise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from kernel_specs import TRITON_ENV, record
from test_moe import EXPERTS, experts_block, gpt_oss_block
from test_moe_grad import inputs as moe_inputs
from test_rope_decode import _case, _norms

from unison.engine import moe
from unison.engine.fused_linear import pack_projections
from unison.engine.rope_decode import rope_paged_decode
from unison.engine.triton_attention import paged_decode
from unison.engine.triton_mla import mla_decode
from unison.engine.triton_moe import block_sizes, fused_experts
from unison.rollout.sample import Sample
from unison.train import fused_experts as train_experts
from unison.train.loss import LossConfig
from unison.train.packing import pack_samples
from unison.train.step import _row_loss

pytestmark = pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="records the interpreter's launches")

LOSSES = [LossConfig(), LossConfig(type="grpo", is_mode="truncate", beta=0.05),
          LossConfig(type="cispo", is_mode="mask", eps_high=5.0), LossConfig(type="gspo")]
"""A first iteration's dapo; later iterations' grpo with the reference's KL, truncated IS; cispo's capped weight with
masked IS; gspo, whose sequence-level ratio takes the chunks' plain backward. Each is a constexpr variant of the
d logits kernel."""


def _row(vocab: int, later: bool):
    g = torch.Generator().manual_seed(0)
    samples = [Sample(tuple(torch.randint(10, vocab, (5,), generator=g).tolist()),
                      tuple(torch.randint(10, vocab, (7,), generator=g).tolist()),
                      tuple((-torch.rand(7, generator=g)).tolist()), (0,) * 7, 1.0, float(1 - 2 * i))
               for i in range(2)]
    (row,) = pack_samples(samples, 32, 0)
    n = row.loss_positions.numel()
    extra = {"old_logprobs": -torch.rand(n, generator=g), "ref_logprobs": -torch.rand(n, generator=g)} if later else {}
    return row, extra


def _train_row(model, cfg: LossConfig):
    row, extra = _row(model.config.vocab_size, cfg.beta > 0)
    model.zero_grad(set_to_none=True)
    loss, *_ = _row_loss(model, row, cfg, row.loss_positions.numel(), 0.7, 8, True, seq_lens=[7] * 2, **extra)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_training_kernels_compile_for_the_h200_and_the_a100(tmp_path: Path):
    specs: dict = {}
    with record(specs):
        qwen3 = tiny_qwen3(dtype=torch.bfloat16)
        pack_projections(qwen3)  # as load_policy lays it out: q/k/v and gate/up joined (unison.train.joined)
        for cfg in LOSSES:
            _train_row(qwen3, cfg)
        _train_row(tiny_qwen3(dtype=torch.bfloat16), LOSSES[0])  # the projections apart
        _train_row(tiny_llama(dtype=torch.bfloat16), LOSSES[0])
        llama = tiny_llama(dtype=torch.bfloat16)
        pack_projections(llama)  # q/k/v joined without q/k norms
        _train_row(llama, LOSSES[0])
    entries = list(specs.values())
    names = {e["name"] for e in entries}
    # the norms (and the residual add in them), RoPE, q/k norm + RoPE, SwiGLU (apart and joined), the lm_head
    # chunks, forward and back
    assert {"_rms_norm_kernel", "_rms_norm_backward_kernel", "_sum_parts_kernel", "_silu_mul_kernel",
            "_gated_rows_kernel", "_rope_kernel", "_forward_kernel", "_backward_kernel"} <= names, names
    assert len({e["module"] for e in entries}) >= 5, {e["module"] for e in entries}
    _compile(entries, tmp_path)


def test_decode_attention_kernels_compile_for_the_h200_and_the_a100(tmp_path: Path):
    """The decode step's attention: alone, and with the q/k norms, RoPE and K/V write in its launch (bf16, the
    engine's 128-wide heads and 16-slot blocks; with q/k norms, and without with a window and four splits), as the GPU
    launches them; with the eager step's int32 tables and context lengths and the graphs' int64 ones."""
    specs: dict = {}
    with record(specs):
        for norm, window, splits in ((True, None, 1), (False, 100, 4)):
            q, k, v, cos, sin, kp, vp, slots, tables, lens = _case(16, 8, 128, 16, [5, 70, 300], torch.bfloat16)
            q_norm, k_norm = _norms(128, torch.bfloat16) if norm else (None, None)
            for index in (torch.int32, torch.int64):
                tables, lens = tables.to(index), lens.to(index)
                rope_paged_decode(q, k, v, cos, sin, kp, vp, slots, tables, lens, 16, 128**-0.5, window, q_norm,
                                  k_norm, splits)
                paged_decode(q, kp, vp, tables, lens, 16, 128**-0.5, window)
    entries = list(specs.values())
    assert {e["name"] for e in entries} == {"_rope_decode_kernel", "_decode_kernel", "_combine_kernel"}
    assert len(entries) == 9  # each attention kernel at both index widths; the combine reads neither
    # The interpreter records its own variant (fp32 dot products, a while loop, no programmatic launch): compile the
    # GPU's, with programmatic launch where it has it (sm_90).
    entries = _upcast_off(entries)
    hopper = json.loads(json.dumps(entries))
    for e in hopper:
        e["kwargs"]["PDL"] = ["value", True]
    _compile(entries, tmp_path, also=[(hopper, "90")])


def test_experts_and_latent_decode_kernels_compile_for_the_h200_and_the_a100(tmp_path: Path):
    """The MoE experts' kernels (routing, gate/up, down; the trainer's backward) at each of ``block_sizes``' three
    tilings, in transformers' default layout (Qwen3-MoE) and GptOss's (transposed, interleaved, biased), bf16; and
    the latent (MLA) decode attention at DeepSeek's widths (rank 512, RoPE 64), one split and four, with the eager
    step's int32 tables and the graphs' int64 ones. As the decode attention's test: the GPU's variants compiled."""
    specs: dict = {}
    with record(specs):
        for family in ("qwen3_moe", "gpt_oss"):
            block = experts_block(torch.bfloat16) if family == "qwen3_moe" else gpt_oss_block(torch.bfloat16, 2)
            layout, gate_up_bias, down_bias = moe.module_layout(block)
            x, idx, w, upstream = moe_inputs(5, 2, torch.bfloat16, seed=1)
            for pairs in (4 * EXPERTS, 16 * EXPERTS, 64 * EXPERTS):  # decode, between, prefill: the three tilings
                sizes = block_sizes(pairs, EXPERTS)
                fused_experts(x, idx, w, block.gate_up_proj, block.down_proj, sizes, gate_up_bias=gate_up_bias,
                              down_bias=down_bias, layout=layout)
            block.requires_grad_(True)
            out = train_experts.experts(x.requires_grad_(True), idx, w.requires_grad_(True), block.gate_up_proj,
                                        block.down_proj, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                        layout=layout)
            (out.float() * upstream).sum().backward()
        g = torch.Generator().manual_seed(0)
        rank, rope, heads, page = 512, 64, 16, 16
        kv_pool = torch.randn(12 * page, 1, rank + rope, generator=g).to(torch.bfloat16)
        q = torch.randn(3, heads, rank + rope, generator=g).to(torch.bfloat16)
        for index in (torch.int32, torch.int64):
            tables = torch.randperm(12, generator=g)[:12].view(3, 4).to(index)
            lens = torch.tensor([5, 40, 64], dtype=index)
            for splits in (1, 4):
                mla_decode(q, kv_pool, rank, tables, lens, page, (rank + rope) ** -0.5, splits)
    entries = list(specs.values())
    names = {e["name"] for e in entries}
    assert {"_routing_kernel", "_gate_up_kernel", "_down_kernel", "_act_grad_kernel", "_input_grad_kernel",
            "_weight_grad_kernel", "_mla_decode_kernel", "_combine_kernel"} <= names, names
    tilings = {tuple(e["kwargs"][k][1] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) for e in entries
               if e["name"] == "_gate_up_kernel"}
    assert len(tilings) >= 3, tilings
    _compile(_upcast_off(entries), tmp_path)


def _upcast_off(entries: list[dict]) -> list[dict]:
    """The recorded variants as the GPU launches them: the interpreter's fp32 upcast (``UPCAST=_INTERPRET``) off,
    bf16 dot products and roundings."""
    for e in entries:
        if "UPCAST" in e["kwargs"]:
            e["kwargs"]["UPCAST"] = ["value", False]
    return entries


def _compile(entries: list[dict], tmp_path: Path, also: list[tuple[list[dict], str]] = ()) -> None:
    """Each recorded variant compiled by Triton's compiler for sm_90 and sm_80, and each of ``also``'s lists for its
    capability: a process for each, all side by side (the compiler is single-threaded; the CI machine has two
    cores, which three processes keep busy where a third compile after two left one idle)."""
    env = {k: v for k, v in os.environ.items() if k not in TRITON_ENV}
    env.update({k: v for k, v in TRITON_ENV.items() if v is not None})
    script = str(Path(__file__).with_name("kernel_specs.py"))
    jobs = [(entries, "90"), (entries, "80"), *also]
    procs = []
    for i, (listed, capability) in enumerate(jobs):
        path = tmp_path / f"specs_{i}.json"
        path.write_text(json.dumps(listed))
        procs.append(subprocess.Popen([sys.executable, script, str(path), capability], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env={**env, "TRITON_CACHE_DIR": str(tmp_path / f"cache_{i}")}))
    for (listed, capability), proc in zip(jobs, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"sm_{capability}:\n" + stdout[-6000:] + stderr[-3000:]
        assert f"{len(listed)} of {len(listed)} compiled" in stdout, stdout[-3000:]
