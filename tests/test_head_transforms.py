"""Head transforms are exact: softcapping, logits_scaling, logit_scale and lm_head_multiplier in the engine's logits
(hence its logprobs) and in the chunked training logprobs and their gradients, each equal to the family's own eager
forward; a forward that changes its logits in a way unison does not know is refused."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from conftest import max_logprob_diff, random_prompts
from transformers import LlamaConfig, LlamaForCausalLM

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.engine.lm_head import HeadTransform, decoder_of, lm_head_of
from unison.rollout.sample import Sample
from unison.train.logprobs import chunked_logprobs, policy_logprobs
from unison.train.packing import pack_samples

# initializer_range 0.2: logits of O(1) spread, so every transform moves the logprobs by O(1) (0.02 leaves them
# near uniform, where a forgotten scale would hardly show).
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=2,
              bos_token_id=1, pad_token_id=0)
MAMBA = dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
CAP, SCALE = HeadTransform(softcap=3.0), HeadTransform(scale=0.25)

# family: (extra config, the transform its forward applies). Gemma2's attention softcap is off here: this file tests
# the head alone (tests/test_parity.py has the attention side).
FAMILIES = {
    "Gemma2": (dict(head_dim=8, final_logit_softcapping=3.0, attn_logit_softcapping=None, sliding_window=8), CAP),
    "Gemma3": (dict(head_dim=8, final_logit_softcapping=3.0, sliding_window=8), CAP),
    "Gemma4": (dict(final_logit_softcapping=3.0), CAP),
    "VaultGemma": (dict(head_dim=8, final_logit_softcapping=3.0, attn_logit_softcapping=None), CAP),
    "NanoChat": (dict(final_logit_softcapping=3.0), CAP),
    "Granite": (dict(logits_scaling=4.0), SCALE),
    "GraniteMoe": (dict(logits_scaling=4.0, **MOE), SCALE),
    "GraniteMoeHybrid": (dict(logits_scaling=4.0, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                              mamba_d_state=8, **MOE), SCALE),
    "HyperCLOVAX": (dict(logits_scaling=0.25), SCALE),  # multiplies by its logits_scaling, where Granite divides
    "Cohere": (dict(logit_scale=0.25), SCALE),
    "Cohere2": (dict(logit_scale=0.25, sliding_window=8), SCALE),
    "Cohere2Moe": (dict(logit_scale=0.25), SCALE),
    "FalconH1": (dict(lm_head_multiplier=0.25, **MAMBA), SCALE),
}
# What the engine runs exactly today (FalconH1 and GraniteMoeHybrid have Mamba layers: refused, tests/test_parity.py).
ENGINE_FAMILIES = ["Gemma2", "Gemma3", "Granite", "Cohere", "Cohere2"]


def build(family: str, attn: str = "unison", seed: int = 0, **overrides) -> torch.nn.Module:
    extra, _ = FAMILIES[family]
    cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(seed)
    return cls._from_config(cls.config_class(**{**COMMON, **extra, **overrides}), attn_implementation=attn,
                            dtype=torch.float32).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_head_equals_the_model_own_logits(family):
    model = build(family, attn="eager")
    head = lm_head_of(model)
    assert head.transform == FAMILIES[family][1]
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    hidden = decoder_of(model)(input_ids=ids).last_hidden_state[0]
    own = model(input_ids=ids).logits[0].float()
    torch.testing.assert_close(head(hidden), own, rtol=1e-5, atol=1e-5)
    assert (hidden @ head.weight.T - own).abs().max() > 0.1  # the transform matters at these weights
    buffer = torch.full((16, own.shape[1]), float("nan"))  # the engine's graphs: their rows of one buffer
    written = head(hidden, out=buffer[:11])
    assert written.data_ptr() == buffer.data_ptr() and torch.equal(written, head(hidden))


def test_gemma_without_a_final_softcap_is_plain():
    extra = {**FAMILIES["Gemma2"][0], "final_logit_softcapping": None}
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, **extra))
    assert lm_head_of(model).transform.is_identity


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_logprobs_equal_teacher_forced_eager(family):
    model = build(family)
    # 16 blocks of 4 tokens for 8 requests of up to 19 + 12 tokens: chunked prefill, then preemption by recompute.
    engine = Engine(model, EngineConfig(num_blocks=16, block_size=4, max_batch_tokens=16, seed=0))
    done = engine.generate(random_prompts([5, 11, 19, 8], vocab=128),
                           SamplingParams(max_new_tokens=12, temperature=0.7, n=2, stop_token_ids=()))
    assert engine.stats()["num_preemptions"] > 0 and all(len(c.token_ids) == 12 for c in done)
    model.set_attn_implementation("eager")
    assert max_logprob_diff(model, done, temperature=0.7) < 1e-4


def test_decode_runner_applies_the_head_transform():
    """The Triton backend's static decode step (tests/test_triton_engine.py; the interpreter on the CPU) computes
    its logits through the same head: Gemma2's softcap, in place, on the runner's output."""
    model = build("Gemma2", num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # the kernels want >= 16
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, seed=0, attention="triton", max_num_seqs=4))
    done = engine.generate(random_prompts([5, 9], vocab=128), SamplingParams(max_new_tokens=6, stop_token_ids=()))
    assert engine.runner is not None and engine.stats()["graph_steps"] >= 4
    model.set_attn_implementation("eager")
    assert max_logprob_diff(model, done) < 1e-4


def samples_for(vocab: int) -> list[Sample]:
    rng = random.Random(4)
    return [Sample(prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(p)),
                   completion_ids=tuple(rng.randrange(3, vocab) for _ in range(c)),
                   engine_logprobs=(0.0,) * c, weight_versions=(0,) * c, reward=0.0, advantage=1.0)
            for p, c in [(5, 9), (3, 7), (6, 4)]]


def eager_logprobs(model, sample: Sample, temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.completion_ids)])
    logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, ids[0, len(sample.prompt_ids):, None]).squeeze(1)


@pytest.mark.parametrize("family", ENGINE_FAMILIES + ["FalconH1"])
def test_training_logprobs_and_grads_equal_eager(family):
    model, temperature = build(family), 0.7
    samples = samples_for(128)
    # (FalconH1's Mamba layers keep a packed row's samples apart: unison.train.boundaries.)
    rows = pack_samples(samples, 64, pad_id=0)
    order = [i for row in rows for i in row.sample_index]
    ours = torch.cat([policy_logprobs(model, row, temperature, chunk_size=5)[0] for row in rows])
    upstream = torch.linspace(-1.0, 1.0, ours.numel())
    (ours * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    model.set_attn_implementation("eager")
    ref = torch.cat([eager_logprobs(model, samples[i], temperature) for i in order])
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    head = lm_head_of(model)
    assert grads[next(n for n, p in model.named_parameters() if p is head.weight)].abs().max() > 1e-3
    # Without the transform the logprobs would be O(1) off: the test sees the head.
    hidden = decoder_of(model)(input_ids=rows[0].input_ids).last_hidden_state[0]
    mask = rows[0].loss_mask
    plain, _ = chunked_logprobs(hidden[mask], head.weight, rows[0].targets[mask], temperature)
    assert (plain - ref[:plain.numel()]).abs().max() > 0.05


def tiny_llama(cls=LlamaForCausalLM) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls._from_config(LlamaConfig(**COMMON), attn_implementation="unison", dtype=torch.float32).eval()


class DoubledLogits(LlamaForCausalLM):
    """A forward that changes its logits after the head: unknown to unison, so refused."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


class ScaledHead(torch.nn.Linear):
    """A head module with its own forward (like Dory's per-token logit scale)."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_unknown_head_transforms_are_refused():
    with pytest.raises(ValueError, match=r"DoubledLogits.forward changes its logits .*out.logits = out.logits \* 2"):
        lm_head_of(tiny_llama(DoubledLogits))
    with pytest.raises(ValueError, match="DoubledLogits"):
        Engine(tiny_llama(DoubledLogits), EngineConfig(num_blocks=8))
    row = pack_samples(samples_for(128)[:1], 64, pad_id=0)[0]
    with pytest.raises(ValueError, match="DoubledLogits"):
        policy_logprobs(tiny_llama(DoubledLogits), row)

    model = tiny_llama()
    model.lm_head = ScaledHead(32, 128, bias=False)
    with pytest.raises(ValueError, match="LlamaForCausalLM: unison needs an nn.Linear lm_head, got ScaledHead"):
        lm_head_of(model)
    model.lm_head = torch.nn.Linear(32, 128, bias=True)
    with pytest.raises(ValueError, match="bias-free"):
        lm_head_of(model)
    assert lm_head_of(tiny_llama()).transform.is_identity  # and the plain Llama head is fine
