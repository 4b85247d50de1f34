"""The engine's kernel swaps planned once (unison.engine.swaps.KernelSwaps): the same forwards in the same places as
``graphs.fused_kernels`` puts them, the modules' own forwards back afterwards (after a failure too), and a new plan
wherever the decoder changed under it."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_qwen3

pytest.importorskip("triton")

from unison.engine import fused_layer, fused_linear  # noqa: E402
from unison.engine.graphs import fused_kernels  # noqa: E402
from unison.engine.swaps import ROPE, KernelSwaps  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fused_layer, "DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(fused_linear, "DEVICES", {"cpu", "cuda"})


def _swapped(decoder: torch.nn.Module) -> tuple[dict, object]:
    """Which modules carry a forward of their own (by name -> its function's name), and the modeling module's RoPE
    (its function's name)."""
    forwards = {name: m.__dict__["forward"].__qualname__ for name, m in decoder.named_modules() if "forward" in
                m.__dict__}
    rope = getattr(sys.modules[type(decoder.layers[0].self_attn).__module__], ROPE)
    return forwards, getattr(rope, "__qualname__", type(rope).__name__)


def _forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_planned_swaps_are_fused_kernels(on_cpu):
    model = tiny_qwen3()
    decoder = model.model
    own = _swapped(decoder)
    swaps = KernelSwaps(decoder, fused_kernels)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with fused_kernels(decoder):
        want, want_out = _swapped(decoder), _forward(model, ids)
    assert len(want[0]) > 4 * len(decoder.layers) and want[1] != own[1]  # norms, q/k/v, layers, attentions, RoPE
    assert _swapped(decoder) == own
    for _ in range(3):
        with swaps():
            assert _swapped(decoder) == want
            assert torch.equal(_forward(model, ids), want_out)
        assert _swapped(decoder) == own
    assert swaps.plans == 1


def test_the_modules_own_forwards_come_back_after_a_failure(on_cpu):
    model = tiny_qwen3()
    decoder = model.model
    own = _swapped(decoder)
    swaps = KernelSwaps(decoder, fused_kernels)
    with swaps():
        pass
    chain = swaps._chains[0]
    with pytest.raises(RuntimeError, match="midway"), swaps():
        chain.put(torch.ones(1), decoder.norm, torch.ones(1))  # what a forward that failed midway leaves
        raise RuntimeError("midway")
    assert _swapped(decoder) == own
    assert chain.total is None and chain.normed is None
    assert swaps.plans == 1


def test_a_changed_decoder_is_planned_again(on_cpu):
    model = tiny_qwen3()
    decoder = model.model
    swaps = KernelSwaps(decoder, fused_kernels)
    with swaps():
        pass
    # A module replaced (a LoRA layer put in, say): its replacement is swapped, and the old one no longer is.
    old = decoder.layers[0].mlp.down_proj
    decoder.layers[0].mlp.down_proj = new = torch.nn.Linear(128, 64, bias=False)
    with swaps():
        assert "forward" in new.__dict__
    assert swaps.plans == 2 and "forward" not in old.__dict__
    # A forward of someone else's on a module: planned again, swapped over, and theirs again afterwards.
    norm = decoder.layers[1].input_layernorm

    def theirs(x):
        return x
    norm.forward = theirs
    with swaps():
        assert norm.__dict__["forward"] is not theirs
    assert swaps.plans == 3 and norm.__dict__["forward"] is theirs
    del norm.forward
    # Their forward gone and parameters of another kind (a dtype conversion): planned once more, then kept.
    model.to(torch.bfloat16)
    for _ in range(2):
        with swaps():
            assert norm.__dict__["forward"].__qualname__ != "theirs"
    assert swaps.plans == 4 and "forward" not in norm.__dict__
