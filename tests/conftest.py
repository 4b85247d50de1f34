"""Tiny models built in the tests (no download) and the teacher-forced references engine tests compare to."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run in Triton's interpreter on the CPU
if os.environ.get("TRITON_INTERPRET"):
    import triton_interpreter

    if not triton_interpreter.speed_up():  # its device calls without their re-patching (tests/triton_interpreter.py)
        import warnings

        warnings.warn("Triton's interpreter is not the one tests/triton_interpreter.py reads: the Triton tests run "
                      "at its own (slower) pace", stacklevel=1)
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import unison.engine.attention  # noqa: F401  (registers the "unison" attention implementation)

# Two threads on the CI's two cores; a process that a test launches beside others (a torchrun rank, a peer) keeps the
# one its launcher asked for (OMP_NUM_THREADS=1): threads beyond the cores spin against each other's processes.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def tiny_llama(seed: int = 0, vocab: int = 256, max_pos: int = 512, dtype=torch.float32) -> LlamaForCausalLM:
    """Llama with GQA (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="unison", dtype=dtype).eval()


def tiny_qwen3(seed: int = 0, vocab: int = 256, max_pos: int = 512, dtype=torch.float32) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=max_pos,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=dtype).eval()


@pytest.fixture(params=["llama", "qwen3"])
def model(request):
    return {"llama": tiny_llama, "qwen3": tiny_qwen3}[request.param]()


def count_calls(monkeypatch, module, names) -> dict[str, int]:
    """Counts the calls of each of ``names`` in ``module`` (each still runs) for the rest of the test."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(module, name)

        def counted(*a, name=name, fn=fn, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


def record_returns(monkeypatch, cls, name: str = "__call__") -> list:
    """What each call of ``cls.name`` returns (each still runs), in order, for the rest of the test."""
    returned, fn = [], getattr(cls, name)

    def recorded(*a, **kw):
        returned.append(fn(*a, **kw))
        return returned[-1]
    monkeypatch.setattr(cls, name, recorded)
    return returned


def drain(engine) -> list:
    """Steps ``engine`` until nothing is left; its completions in request order, a request's turns by prompt
    length."""
    done = []
    while engine.num_unfinished:
        done += engine.step()
    return sorted(done, key=lambda c: (c.request_id, len(c.prompt_ids)))


def random_prompts(lengths, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def teacher_forced_logprobs(model, prompt_ids, token_ids, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """log p(token_ids[i] | prompt, token_ids[:i]) from one plain forward, with the sampler's processing
    (temperature, then top-k, then top-p, renormalised). Returns (len(token_ids),) float32."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=model.device)
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float().cpu()
    logits = logits / (temperature if temperature > 0 else 1.0)
    if top_k > 0 or top_p < 1:
        logits = torch.stack([nucleus_reference(row, top_k, top_p) for row in logits])
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)


def max_logprob_diff(model, completions, **sampling) -> float:
    diff = 0.0
    for c in completions:
        ref = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids, **sampling)
        diff = max(diff, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return diff


def nucleus_reference(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row, written independently of the sampler: keep the k most likely tokens, then the smallest set of
    those (in order) whose renormalised mass reaches top_p; everything else -inf."""
    order = logits.argsort(descending=True)
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(logits[keep].double(), dim=0)
    kept, mass = [], 0.0
    for token, q in zip(keep.tolist(), probs.tolist(), strict=True):
        if top_p < 1 and mass >= top_p:
            break
        kept.append(token)
        mass += q
    out = torch.full_like(logits, float("-inf"))
    out[kept] = logits[kept]
    return out


def tiny_tokenizer(vocab: int = 256):
    """A real fast tokenizer: ids 0, 1, 2 are <pad>, <unk>, <eos>; id i >= 3 is the word "w{i}". No chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny Llama and tokenizer saved as a local HF folder, as `unison train` loads a model."""
    path = tmp_path_factory.mktemp("tiny")
    model, tok = tiny_llama(), tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
