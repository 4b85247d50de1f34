"""Vision-language models (issue 25): tiny random Qwen2.5-VL (multimodal RoPE) and SmolVLM (Idefics3's layout), fp32
on the CPU, against each model's own forward (pixels in, transformers' own image merging and positions)."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from vlm_models import FAMILIES, random_image, tiny_vlm, user_turn

from unison.config import InvalidInputError, load_config
from unison.engine import Engine, EngineConfig, SamplingParams, fused_layer
from unison.engine.fused_layer import fused_layers
from unison.models import load_policy, load_processor
from unison.rollout.remote import RemoteEngine
from unison.rollout.sample import Sample
from unison.serve import GenerationServer, make_handler
from unison.sync import Receiver
from unison.train.build import build_run
from unison.train.config import TrainConfig
from unison.train.logprobs import policy_logprobs
from unison.train.loop import train
from unison.train.loss import LossConfig
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.packing import pack_samples
from unison.train.step import train_step
from unison.vision import model as vlm
from unison.vision.images import encode_image
from unison.vision.prompt import ImagePrompter, render

TEXT = "w5 w6 w7 w8 w9 w10 w11"


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_pair(request):
    return request.param, *tiny_vlm(request.param)


def own_logprobs(model, processor, messages, images, prompt_ids, token_ids) -> torch.Tensor:
    """The model class's own forward over prompt + completion, the processor's pixels in: logprobs of the tokens, up
    to the first image placeholder the policy sampled (``unison.vision.model.scored_tokens``: compare that many)."""
    token_ids = list(token_ids)
    if images:
        token_ids = token_ids[:vlm.scored_tokens(model, token_ids)]
    out = processor(text=[render(processor, messages)], images=images, return_tensors="pt")
    assert out["input_ids"][0].tolist() == list(prompt_ids)
    pixels = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    extra = {}
    if "mm_token_type_ids" in out:  # Qwen's positions read it; completion tokens are text
        extra["mm_token_type_ids"] = torch.cat([out["mm_token_type_ids"],
                                                torch.zeros(1, len(token_ids) - 1, dtype=torch.long)], 1)
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # Qwen caches the last call's
    dev = model.device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt_ids) + token_ids[:-1]], device=dev),
                       **{k: v.to(dev) for k, v in {**pixels, **extra}.items()}).logits[0]
    p = len(prompt_ids)
    return torch.log_softmax(logits[p - 1:].float(), -1).gather(1, torch.tensor(token_ids, device=dev)[:, None]
                                                                  ).squeeze(1).cpu()


def run(engine: Engine, prompts) -> list:
    ids = [rid for prompt_ids, images, params in prompts for rid in engine.submit(prompt_ids, params, images=images)]
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    return [done[i] for i in ids]


@pytest.mark.parametrize("fused", [False, True])
def test_engine_logprobs_equal_the_models_own_forward(vlm_pair, fused, monkeypatch):
    """Chunked prefill (8 tokens a step) through the image tokens, preemption (12 blocks of 4 for 4 samples), n=2;
    and through the GPU's fused decoder layers (unison.engine.fused_layer, here in Triton's interpreter): Qwen3-VL
    adds its deepstack features between layers, where the fused add must not pass the layer's sum on."""
    family, model, processor = vlm_pair
    prompter = ImagePrompter(model, processor)
    cases = [(user_turn(TEXT), [random_image(0)]), (user_turn("w9 w3", images=2), [random_image(1), random_image(2)])]
    engine = Engine(model, EngineConfig(num_blocks=12, block_size=4, max_batch_tokens=8, seed=0))
    fused_adds = []
    if fused:
        monkeypatch.setattr(fused_layer, "DEVICES", {"cpu", "cuda"})
        add = fused_layer.add_rms_norm
        monkeypatch.setattr(fused_layer, "add_rms_norm", lambda *a: fused_adds.append(1) or add(*a))
        engine._fused = lambda: fused_layers(engine.decoder)
    prompts = [(*prompter(m, imgs), SamplingParams(max_new_tokens=6, n=2, stop_token_ids=())) for m, imgs in cases]
    done = run(engine, prompts)
    assert engine.stats()["num_preemptions"] > 0
    assert bool(fused_adds) == fused
    for i, c in enumerate(done):
        messages, images = cases[i // 2]
        ref = own_logprobs(model, processor, messages, images, c.prompt_ids, c.token_ids)
        assert (ref - torch.tensor(c.logprobs[:len(ref)])).abs().max() < 1e-4, (family, i)


def test_same_text_with_other_images_shares_no_kv_and_answers_otherwise(vlm_pair):
    family, model, processor = vlm_pair
    prompter = ImagePrompter(model, processor)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=())
    a, b, a2 = (prompter(user_turn(TEXT), [random_image(s)]) for s in (0, 1, 0))
    assert a[0] == b[0] and a[1].digest != b[1].digest and a[1].digest == a2[1].digest  # same tokens, other pixels
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_batch_tokens=64, seed=0))
    first = run(engine, [(*a, greedy)])[0]
    hits = engine.scheduler.prefix_hits
    other = run(engine, [(*b, greedy)])[0]
    # Only the blocks before the first image token are shared (the image starts at token 2: block 0 holds it).
    shared = engine.scheduler.prefix_hits - hits
    assert shared == (a[1].first_image_token // 4) * 4
    assert other.token_ids != first.token_ids
    again = run(engine, [(*a2, greedy)])[0]
    assert engine.scheduler.prefix_hits - hits - shared == (len(a[0]) - 1) // 4 * 4  # the same image: all reused
    assert again.token_ids == first.token_ids
    assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(first.logprobs), atol=1e-5)


def samples_with_images(model, processor):
    """Three samples for one packed row: two prompts with other images, one text-only prompt."""
    prompter = ImagePrompter(model, processor)
    g = torch.Generator().manual_seed(0)
    out = []
    for text, images in ((TEXT, [random_image(0)]), ("w4 w8", [random_image(3), random_image(4)]), ("w7 w7 w9", [])):
        if images:
            prompt_ids, prompt = prompter(user_turn(text, len(images)), images)
        else:
            prompt_ids, prompt = processor.tokenizer(render(processor, user_turn(text, 0)))["input_ids"], None
        completion = torch.randint(3, 250, (5,), generator=g).tolist()
        out.append((user_turn(text, len(images)), images, Sample(
            tuple(prompt_ids), tuple(completion), (0.0,) * 5, (0,) * 5, 1.0, 0.5, images=prompt)))
    return out


def test_packed_row_with_images_equals_the_models_own_forward(vlm_pair):
    family, model, processor = vlm_pair
    cases = samples_with_images(model, processor)
    [row] = pack_samples([s for *_, s in cases], 128, pad_id=0, pad_to=8)
    assert len(row.images) == row.cu_seqlens.numel() - 1  # one per segment, padding included
    with torch.no_grad():
        packed, _ = policy_logprobs(model, row)
    offset = 0
    sizes = [len(cases[i][2].completion_ids) for i in row.sample_index]
    for i, n in zip(row.sample_index, sizes, strict=True):
        messages, images, s = cases[i]
        ref = own_logprobs(model, processor, messages, images or None, s.prompt_ids, s.completion_ids)
        assert (packed[offset:offset + len(ref)] - ref).abs().max() < 1e-4, (family, i)
        offset += n


def test_packed_gradients_equal_per_sample(vlm_pair):
    """Every language-model parameter's gradient from one packed row equals the sum over one-sample rows."""
    family, model, processor = vlm_pair
    samples = [s for *_, s in samples_with_images(model, processor)]

    def grads(rows):
        model.zero_grad()
        for row in rows:
            policy_logprobs(model, row)[0].sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed = grads(pack_samples(samples, 128, pad_id=0))
    alone = grads([r for s in samples for r in pack_samples([s], 128, pad_id=0)])
    assert packed.keys() == alone.keys() and len(packed) > 5
    for name in packed:
        assert torch.allclose(packed[name], alone[name], atol=1e-5), name


def test_a_step_trains_the_language_model_and_leaves_the_frozen_tower(vlm_pair):
    family, model, processor = vlm_pair
    model, processor = tiny_vlm(family, seed=1)  # a fresh copy: this test changes its weights
    tower = vlm.freeze_vision(model, train=False)
    assert tower > 0 and not vlm.vision_trains(model)
    samples = []
    for *_, s in samples_with_images(model, processor):  # the engine's logprobs: the policy's own
        with torch.no_grad():
            own = policy_logprobs(model, pack_samples([s], 128, pad_id=0)[0])[0]
        samples.append(dataclasses.replace(s, engine_logprobs=tuple(own.tolist())))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-2), total_steps=2)
    metrics = train_step(model, opt, samples, LossConfig(), 1.0, 128, 0, 16)
    assert metrics["mismatch/logprob_diff_max"] < 1e-5 and metrics["optim/grad_norm"] > 0
    tower = {f"model.{n}" for n, _ in model.model.named_parameters()
             if n.split(".")[0] in ("visual", "vision_model", "connector")}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert tower and not changed & tower
    assert any("layers" in n for n in changed)


def test_a_trained_tower_gets_its_gradient(vlm_pair):
    family, model, processor = vlm_pair
    vlm.freeze_vision(model, train=True)
    try:
        [row] = pack_samples([s for *_, s in samples_with_images(model, processor)], 128, pad_id=0)
        model.zero_grad()
        policy_logprobs(model, row)[0].sum().backward()
        grads = [p.grad for m in vlm.vision_tower(model) for p in m.parameters()]
        assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    finally:
        model.zero_grad()
        vlm.freeze_vision(model, train=False)


def test_images_for_a_class_unison_does_not_run_are_refused():
    import transformers

    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4, image_token_index=299)
    model = transformers.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="unison")
    with pytest.raises(ValueError, match="bidirectionally"):
        vlm.family_of(model)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """The tiny Qwen2.5-VL and its processor saved as a local HF folder, as `unison train` loads a model."""
    path = tmp_path_factory.mktemp("vlm")
    model, processor = tiny_vlm("qwen2_5_vl")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def vlm_run_cfg(model_dir, out, *overrides):
    return load_config(TrainConfig, None, [
        f"--output_dir={out}", f"--model.name_or_path={model_dir}", "--max_steps=1", "--rollout.group_size=4",
        "--rollout.samples_per_step=8", "--rollout.max_new_tokens=6", "--data.source=count_shapes", "--data.size=8",
        '--data.gym={"image_size": 56}', "--optim.lr=1e-3", "--log.report_to=[none]", *overrides])


def test_unison_train_on_drawn_images(vlm_dir, tmp_path):
    """The built-in drawn-image task through `unison train`: the engine and the trainer agree, the checkpoint holds
    the processor and loads back, the frozen tower's weights are the ones it started from."""
    out = tmp_path / "run"
    last = train(vlm_run_cfg(vlm_dir, out))
    assert last["mismatch/logprob_diff_max"] < 1e-4 and last["train/samples"] == 8
    saved = out / "checkpoint"
    assert (saved / "processor_config.json").is_file()
    model, _ = load_policy(str(saved))
    start, _ = load_policy(vlm_dir)
    assert type(load_processor(str(saved))).__name__ == "Qwen2_5_VLProcessor"
    tower = dict(model.model.visual.named_parameters())
    assert all(torch.equal(p, tower[n]) for n, p in start.model.visual.named_parameters())
    text = dict(model.model.language_model.named_parameters())
    assert any(not torch.equal(p, text[n]) for n, p in start.model.language_model.named_parameters())


def test_rows_with_images_need_a_vision_language_model(model_dir, tmp_path):
    with pytest.raises(InvalidInputError, match="text-only model"):
        build_run(vlm_run_cfg(model_dir, tmp_path / "run"))


def test_unison_serve_takes_images(tmp_path):
    """A served VLM (its own copy of the weights) answers a RemoteEngine's prompt with images as the model's own
    forward does; images sent to a text-only server, or that do not decode, fail that request alone (400)."""
    model, processor = tiny_vlm("qwen2_5_vl")
    served, _ = tiny_vlm("qwen2_5_vl")
    server = GenerationServer(Engine(served, EngineConfig(num_blocks=64, block_size=4, seed=0)),
                              Receiver(dict(served.named_parameters()), version=0),
                              images=ImagePrompter(served, processor))
    llama = tiny_llama()
    text_only = GenerationServer(Engine(llama, EngineConfig(num_blocks=64, block_size=4, seed=0)),
                                 Receiver(dict(llama.named_parameters()), version=0))
    urls = []
    for s in (server, text_only):
        s.start()
        http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(s, timeout=60))
        threading.Thread(target=http.serve_forever, daemon=True).start()
        urls.append((http, f"http://127.0.0.1:{http.server_address[1]}"))
    try:
        messages, images = user_turn(TEXT), [random_image(5)]
        prompt_ids, prompt = ImagePrompter(model, processor)(messages, images)
        remote = RemoteEngine([urls[0][1]], timeout=60)
        remote.submit(prompt_ids, SamplingParams(max_new_tokens=6, n=2, stop_token_ids=()), images=prompt)
        done = []
        while len(done) < 2:
            done += remote.step()
        for c in done:
            ref = own_logprobs(model, processor, messages, images, prompt_ids, c.token_ids)
            assert (ref - torch.tensor(c.logprobs[:len(ref)])).abs().max() < 1e-4
        body = {"prompt": prompt_ids, "max_tokens": 2, "images": [encode_image(images[0])]}
        status, reply = post(urls[1][1], body)
        assert status == 400 and "text-only" in reply["error"]
        status, reply = post(urls[0][1], {**body, "images": ["data:image/png;base64,AAAA"]})
        assert status == 400 and "image" in reply["error"]
        status, reply = post(urls[0][1], {**body, "images": [encode_image(images[0])] * 2})  # one placeholder run
        assert status == 400 and "image tokens" in reply["error"]
    finally:
        for (http, _), s in zip(urls, (server, text_only), strict=True):
            http.shutdown()
            s.stop()


def post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(payload).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_prompts_through_the_tower_together_equal_one_by_one(vlm_pair):
    """``ImagePrompter.batch`` (what the rollout loop admits at once): the same ids and rows as one prompt at a time;
    a prompt whose images do not fit its messages comes back as its error, the others unharmed."""
    family, model, processor = vlm_pair
    prompter = ImagePrompter(model, processor)
    prompts = [(user_turn(TEXT), [random_image(0)]), (user_turn("w4", 2), [random_image(1), random_image(2)]),
               (user_turn("w5", 2), [random_image(3)])]  # two placeholders, one image
    together = prompter.batch(prompts)
    assert isinstance(together[2], ValueError)
    for (messages, images), (ids, prompt) in zip(prompts[:2], together[:2], strict=True):
        alone_ids, alone = prompter(messages, images)
        assert ids == alone_ids and prompt.digest == alone.digest
        assert torch.allclose(prompt.embeds, alone.embeds, atol=1e-5)
        assert len(prompt.deepstack) == len(alone.deepstack)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(prompt.deepstack, alone.deepstack, strict=True))


def test_the_resume_fingerprint_sees_the_images():
    """A resumed run's saved data order must refer to the same rows: other pictures behind the same prompts differ."""
    from unison.train.resume import data_fingerprint

    rows = [{"prompt": "How many?", "images": [random_image(0)]}]
    same = [{"prompt": "How many?", "images": [random_image(0)]}]
    other = [{"prompt": "How many?", "images": [random_image(1)]}]
    assert data_fingerprint(rows) == data_fingerprint(same) != data_fingerprint(other)
    assert data_fingerprint([{"prompt": "x"}]) == data_fingerprint([{"prompt": "x", "images": []}])


def test_a_text_models_prompt_of_text_parts_renders_as_its_string():
    """Conversations whose contents are part lists load for every model; a text model's template gets strings."""
    from unison.rollout.loop import encode_prompt

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}]}]
    assert encode_prompt(tok, parts) == encode_prompt(tok, [{"role": "user", "content": "w5 w6\nw7"}]) == [5, 6, 7]


def test_images_that_are_not_the_prompts_are_refused_at_submit(vlm_pair):
    family, model, processor = vlm_pair
    prompter = ImagePrompter(model, processor)
    ids, prompt = prompter(user_turn(TEXT), [random_image(0)])
    other_ids, _ = prompter(user_turn("w4", 2), [random_image(1), random_image(2)])
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, seed=0))
    with pytest.raises(ValueError, match="image tokens"):
        engine.submit(other_ids, SamplingParams(max_new_tokens=2), images=prompt)
    with pytest.raises(ValueError, match="image tokens"):
        engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2), images=prompt)
    assert engine.num_unfinished == 0
    engine.submit(ids, SamplingParams(max_new_tokens=2), images=prompt)
    assert engine.num_unfinished == 1
