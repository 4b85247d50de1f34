"""Tensor parallelism on two GPUs (run on the GPU machine: ``pytest -m gpu``): the engine's decode step under tp=2
runs as a CUDA graph with the NCCL all-reduces inside, and its logprobs are the whole model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_tokenizer
from test_tensor_parallel import free_port
from transformers import Qwen3Config, Qwen3ForCausalLM

pytestmark = pytest.mark.gpu
PEERS = os.path.join(os.path.dirname(__file__), "peers")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_tensor_parallel_decode_graphs_on_two_gpus(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=2, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "model")
    tok = tiny_tokenizer(4096)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(tmp_path / "model")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(PEERS, "tp_gpu_peer.py"), str(tmp_path / "model"),
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print({k: v for k, v in ranks[0].items() if "tokens" not in k})
    for r in ranks:
        assert r["graph_steps"] > 0  # the decode steps replayed graphs
        # fp32 sharded decode vs the whole model teacher-forced: summation order only, before and after the
        # shards were updated in place.
        assert r["diff"] < 1e-3 and r["eager_diff"] < 1e-3 and r["diff_after"] < 1e-3
        assert r["tokens"] == ranks[0]["tokens"] and r["tokens_after"] == ranks[0]["tokens_after"]
    assert ranks[0]["tokens_after"] != ranks[0]["tokens"]  # the step moved the weights the graphs read


def test_fp32_partial_products_on_gpu():
    """The row-wise partial product on a GPU comes out of cuBLAS in fp32 (``torch.mm(..., out_dtype=)``), and two
    of them summed and rounded once give what one bf16 GEMM of the whole gives."""
    from unison.dist.tensor_parallel import _fp32_product, _mm_writes_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 2048, generator=g, device="cuda").bfloat16()
    w = torch.randn(1024, 2048, generator=g, device="cuda").bfloat16()
    assert _mm_writes_fp32(x.device)
    product = _fp32_product(x, w)
    assert product.dtype == torch.float32
    torch.testing.assert_close(product, x.float() @ w.float().T, rtol=1e-5, atol=1e-3)
    halves = sum(_fp32_product(x[:, k:k + 1024], w[:, k:k + 1024]) for k in (0, 1024)).bfloat16()
    assert (halves == torch.nn.functional.linear(x, w)).float().mean() > 0.99
