"""Chat templates: the family's template for a tokenizer that ships without one, and the tokens that end a turn.

A model stops answering where its chat template ends the assistant's turn, and that token is often not the
tokenizer's eos: Gemma ends a turn with ``<end_of_turn>`` (eos is ``<eos>``), ChatML models with ``<|im_end|>``,
Llama 3 with ``<|eot_id|>``, and GLM's template closes no turn at all: the next one opens with ``<|user|>``. Rather
than a list of such tokens per family, ``turn_end_ids`` reads them off the template: it renders a conversation
(user, assistant, user) and takes the special token that follows the assistant's words.

>>> turn_end_ids(gemma_tokenizer)   # doctest: +SKIP
[106]
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# SmolLM2-Instruct's own template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The family's own template, for a tokenizer (a converted GGUF, say) that has the family's tokens but no template.
# Each keyed by the tokens that identify the family; the first family whose tokens are all in the vocabulary wins.
FAMILY_TEMPLATES: dict[tuple[str, ...], tuple[str, str]] = {
    ("<|im_start|>", "<|im_end|>"): ("ChatML", CHATML_TEMPLATE),
    ("<start_of_turn>", "<end_of_turn>"): ("Gemma", (  # Gemma has no system role: it opens the first user turn
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}{% else %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' + ns.system"
        " + (message['content'] | trim) + '<end_of_turn>\\n' }}{% set ns.system = '' %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")),
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"): ("Llama 3", (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")),
    ("<|user|>", "<|assistant|>"): ("GLM-4", (
        "[gMASK]<sop>{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")),
}

_PROBE = "unison turn-end probe"


def family_template(tokenizer) -> tuple[str, str] | None:
    """(family name, chat template) for the first family whose tokens the vocabulary has, else None."""
    vocab = tokenizer.get_vocab()
    for tokens, named in FAMILY_TEMPLATES.items():
        if all(t in vocab for t in tokens):
            return named
    return None


def turn_end_ids(tokenizer) -> list[int]:
    """The special token the chat template puts right after an assistant's message (the one the model emits to end
    its turn), as a list of zero or one ids; empty without a template or where plain text follows."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE},
                {"role": "user", "content": "and again"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # a template that refuses this conversation (roles it does not know): no extra stop
        log.debug("the chat template cannot render a probe conversation (%s): no turn-end token read from it", e)
        return []
    at = text.find(_PROBE) if isinstance(text, str) else -1
    if at < 0:
        return []
    after = text[at + len(_PROBE):].lstrip()
    # The special token the text after the message starts with, written out (an unknown word is not one, though
    # it would tokenize to <unk>); the longest where one special token's text begins another's.
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    starts = [content for content in special if after.startswith(content)]
    return [int(special[max(starts, key=len)])] if starts else []
