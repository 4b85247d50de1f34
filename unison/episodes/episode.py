"""One multi-turn episode as one token sequence, and the chat rendering that extends it turn by turn.

The trained sequence is exactly the tokens the engine saw: the prompt, then each model turn as sampled, then each
tool turn as the tokens appended to the request (``Engine.extend``). Those appended tokens are the chat template's
rendering *delta*: render the conversation with the assistant turn, render it again with the tool replies and the
next assistant header, and tokenize what the second adds. Two checks keep this honest: the template must be
prefix-preserving (the second rendering starts with the first; a template that drops earlier reasoning is not, and
is refused), and the model's own tokens must decode to the text the template renders for its turn (else the episode
ends there, counted as ``template_mismatch``: training on a conversation the template would not reproduce would
teach the model a context it never sees at inference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..rollout.sample import Sample

TOOLS_SYSTEM = (
    "You can call functions. Their signatures, as JSON schemas, are in <tools></tools>:\n<tools>\n{schemas}\n"
    "</tools>\nTo call one, reply with a JSON object in <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>\n'
    "The result comes back in a tool message. When you have the answer, reply without a tool call."
)
"""How tools are shown to a model whose chat template takes no ``tools`` (SmolLM2-135M's plain ChatML): the
Hermes function-calling system prompt, which SmolLM2's own function-calling data follows."""


class TemplateError(ValueError):
    """The chat template cannot extend the conversation token for token (not prefix-preserving)."""


class ChatRenderer:
    """Renders conversations with the tokenizer's chat template, the tools' schemas included."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (tool replies are rendered "
                             "with it); set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.system_prompt = system_prompt
        self._template_takes_tools = "tools" in tokenizer.chat_template

    def messages_of(self, prompt: str | list[dict], observation: str | None = None) -> list[dict]:
        """A row's prompt as messages (a string is one user message), the system prompt and, where the template
        takes no tools, the tools' description first; ``observation`` (what ``reset`` returned) ends the last user
        message."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"a conversational prompt is a list of {{'role': ..., 'content': ...}} messages, got "
                                 f"{m!r:.120}")
        if observation:
            last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last is None:
                messages.append({"role": "user", "content": observation})
            else:
                messages[last] = {**messages[last], "content": f"{messages[last]['content']}\n\n{observation}"}
        system = [self.system_prompt] if self.system_prompt and messages[0]["role"] != "system" else []
        if self.tools and not self._template_takes_tools:
            system.append(TOOLS_SYSTEM.format(schemas="\n".join(json.dumps(s) for s in self.tools)))
        if system and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": "\n\n".join([messages[0]["content"], *system])}
        elif system:
            messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
        return messages

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools and self._template_takes_tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def continuation(self, context_ids: list[int], messages: list[dict], replies: list[dict]) -> list[int] | None:
        """The tokens that extend ``context_ids`` (the conversation so far, ending with the model's turn, which is
        ``messages[-1]``) by ``replies`` and the next assistant header; None where the template renders the model's
        turn as other text than its tokens decode to. Raises TemplateError for a template that is not
        prefix-preserving."""
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + replies, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template is not prefix-preserving: rendering the conversation with the tool replies "
                "changes what it rendered before them (templates that drop earlier reasoning do this), so the "
                "episode cannot be one token sequence. Use a chat template that renders earlier turns unchanged")
        seen = self.decode(context_ids)
        if not after.startswith(seen):
            return None
        return self.encode(after[len(seen):])


@dataclass
class Episode:
    """A conversation in progress: the prompt's tokens, then every later token with whose it is (``mask``: True
    for the model's own tokens, which carry the engine's logprob and weight version; False for tool and
    environment tokens, which are context only)."""

    row: dict
    messages: list[dict]
    prompt_ids: list[int]
    environment: object | None = None
    tools: object | None = None  # the episode's ToolBox
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0
    last_text: str = ""  # the model's last turn, what reward functions score as the completion
    last_ids: list[int] = field(default_factory=list)  # ... and its token ids (reward functions' completion_ids)
    finish_reason: str = "stop"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.tokens += token_ids
        self.mask += [True] * len(token_ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns += 1

    def add_context(self, token_ids: list[int]) -> None:
        """Tool or environment tokens: in the sequence, out of the loss, no engine logprob."""
        version = self.versions[-1] if self.versions else 0
        self.tokens += token_ids
        self.mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)

    def sample(self, reward: float, advantage: float, group_id: str, shown: dict | None = None) -> Sample:
        return Sample(tuple(self.prompt_ids), tuple(self.tokens), tuple(self.logprobs), tuple(self.versions),
                      reward, advantage, group_id, self.finish_reason, completion_mask=tuple(self.mask), shown=shown)
