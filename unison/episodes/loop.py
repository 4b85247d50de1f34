"""The multi-turn rollout loop: each sample an episode of model turns and tool (or environment) turns.

It is ``RolloutLoop`` with episodes in place of single completions: a group's episodes start as one engine group
(their shared prompt prefilled once), and after each model turn that calls tools the loop runs them, renders their
replies with the chat template and extends the same engine request with those tokens (``Engine.extend``: the
conversation is never prefilled again; an engine without ``extend``, such as the clients of ``unison serve``, gets
each next turn as a new request of the whole conversation instead). A step's tool calls of every episode run at
once, in threads. A turn without tool calls goes to the environment's ``respond(text)`` where it has one (its reply
is the next user message, rendered and appended the same way; None ends the episode). An episode ends when the model
answers without a tool call and no environment responds, at ``max_turns``, when the next turn would not fit
``max_tokens``, or when its completion is cut by length. It is then scored (reward functions see the model's last
turn as the completion and, with an environment, the episode's object as ``environments``; with reward workers and
no environment, in the workers while the engine decodes on) and becomes one ``Sample`` whose mask trains only the
model's tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from ..dist.tensor_parallel import on_main
from ..dist.topology import Ranks
from ..engine import Completion
from ..engine.seeding import group_seed
from ..engine.stop import decoder
from ..rollout.advantage import group_advantages
from ..rollout.loop import RolloutLoop
from ..rollout.rewards import RewardScorer, Scored, Scoring
from ..rollout.sample import shown
from .environment import Failed, environment_tools, reset_environment, respond_all, responds
from .episode import ChatRenderer, Episode
from .parsing import ParsedTurn, parse_tool_calls
from .tools import ERROR_KINDS, ToolBox, ToolConfig, ToolResult, cut, in_background

log = logging.getLogger(__name__)


@dataclass
class EpisodeConfig:
    max_turns: int = 4
    """Model turns per episode; the last one's tool calls are not run."""
    max_tokens: int | None = None
    """Tokens per episode (prompt, every turn, every tool reply: the packed training row); None: the trainer's
    step.max_tokens_per_row."""
    tool_timeout_s: float = 10.0
    """Wall time of one tool call (or environment respond); past it the model reads that the call timed out (a
    respond past it drops its episode)."""
    max_tool_result_chars: int = 2000
    """A tool reply (or an environment's respond reply) is cut to this many characters."""
    tools_in_background: bool = True
    """A turn's tool calls (or the environment's respond) run while the engine decodes the other episodes, and the
    reply joins its episode at the first engine step after it arrives (at least one step after the turn ended): a
    slow tool holds up its own episode only. False: every engine step's calls finish before the next step, so the
    step a reply lands on (and with it the run) does not depend on how long the tools took. Under tensor
    parallelism rank 0 runs the calls and, before each engine step while any are out, tells every rank which
    replies join (a broadcast over a gloo group: the host's, the device is not waited for)."""

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"EpisodeConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"EpisodeConfig.max_tokens must be >= 2, got {self.max_tokens}")
        ToolConfig(self.tool_timeout_s, self.max_tool_result_chars)  # validates the tool fields


@dataclass
class _EpisodeGroup:
    row: dict
    prompt_text: str
    pending: int
    group_id: str = ""  # the engine's, from the first completion that lands
    landed: list[tuple[Episode, float | None, dict | None]] = field(default_factory=list)  # with what the log shows


@dataclass
class _Awaiting:
    """A finished model turn whose tool calls (``parsed``) or environment respond (``parsed`` None) run in the
    background: ``reply`` is their list of ``ToolResult``, or respond's reply."""

    completion: Completion
    episode: Episode
    parsed: ParsedTurn | None
    reply: Future | None  # None on tensor-parallel ranks other than 0 (rank 0 runs the calls)
    step: int  # the loop's engine steps when the turn ended


class MultiTurnRolloutLoop(RolloutLoop):
    """``RolloutLoop``'s arguments, plus ``tools`` (plain functions shared by every episode) and/or
    ``environment_factory`` (one object per episode, its public methods the tools). ``tp``: a tensor-parallel group
    whose ranks run this loop in lockstep (best a gloo one, ``unison.dist.tensor_parallel.host_ranks``); its rank 0
    alone resets the environments and runs the tool calls and ``respond``, and every rank continues its episodes with
    rank 0's observations and replies, at the same engine steps (a tool run on every rank could answer each
    differently, or time out on one: the ranks' requests would part ways)."""

    def __init__(self, engine, tokenizer, rows, reward_fns, cfg, *args, episode_cfg: EpisodeConfig | None = None,
                 tools: list[Callable] = (), environment_factory: Callable[[], object] | None = None,
                 tp: Ranks | None = None, **kwargs):
        if environment_factory is not None and kwargs.get("scorer") is None:  # the rewards read live environments
            kwargs["scorer"] = RewardScorer(reward_fns)  # here, not in reward workers (which would get copies)
        super().__init__(engine, tokenizer, rows, reward_fns, cfg, *args, **kwargs)
        self.tp = tp
        self.runs_tools = tp is None or tp.is_main
        # The local engine continues a request on its own KV; an engine without extend() (the clients of `unison
        # serve`) gets each next turn as a new request of the whole conversation (its prefix cache may serve it).
        self.continues = hasattr(engine, "extend")
        if not tools and environment_factory is None:
            raise ValueError("a multi-turn rollout needs tools or an environment_factory")
        self.episode_cfg = episode_cfg or EpisodeConfig()
        self.tool_cfg = ToolConfig(self.episode_cfg.tool_timeout_s, self.episode_cfg.max_tool_result_chars)
        self.max_tokens = self.episode_cfg.max_tokens or self.max_sample_tokens or getattr(engine, "max_model_len", 0)
        if not self.max_tokens:
            raise ValueError("multi-turn episodes need a token limit: set episode.max_tokens")
        self.tools = list(tools)
        self.toolbox = ToolBox(self.tools, self.tool_cfg) if self.tools else None
        self.environment_factory = environment_factory
        self.episodes: dict[str, Episode] = {}  # request id -> its episode
        self.awaiting: dict[str, _Awaiting] = {}  # request id -> its turn's tools running in the background
        self.tool_wait_s = 0.0  # the loop's wait for tools with nothing to decode, since the last batch
        # A reply that is in joins its episode once an engine step has passed since its turn ended (unless nothing
        # else is left to decode): a call that returns at once has returned by then (its thread had a whole step),
        # so with such tools the episodes do not hang on the threads' timing. (The engine continues and frees a
        # request whose guessed row is still in flight without waiting for it, so this costs no overlap.)
        self.steps = 0  # engine steps landed
        self.episode_window: dict[str, list[float]] = {"turns": [], "tool_calls": [], "tool_s": [],
                                                       "model_tokens": [], "context_tokens": []}

    # -- starting episodes --------------------------------------------------------------------------------

    def _fill(self) -> None:
        self._collect(block=False)  # replies that arrived since the last step join their episodes first
        self._start_groups()
        if self.awaiting and not self.engine.num_unfinished:  # nothing to decode: wait for the first reply
            self._collect(block=True)

    def _start_groups(self) -> None:
        tries = 0
        while self.in_flight + self.cfg.group_size <= self.cfg.max_concurrent_rollouts and tries < len(self.rows):
            tries += 1
            row = self._next_row()
            episodes = [ep for ep in self._start_group(row) if ep is not None]
            if len(episodes) < 2:  # no advantage without two episodes
                self.counts["skipped_prompts"] += 1
                continue
            group = _EpisodeGroup(row, _prompt_text(row["prompt"]), len(episodes))
            try:
                self._submit(episodes, group)
            except ValueError as e:  # a prompt longer than the context or the row: skipped and counted
                self.counts["skipped_prompts"] += 1
                log.warning("skipping a prompt: %s", e)
                if tries >= len(self.rows) and not self.in_engine:  # a whole pass without a usable prompt
                    raise RuntimeError(f"no prompt can be rolled out; the last was skipped because: {e}") from e
                continue
            tries = 0

    def _start_group(self, row: dict) -> list[Episode | None]:
        """A group's episodes of ``row``; None for one whose environment failed to start (dropped and counted)."""
        if self.environment_factory is None:
            return [self._episode(row, None, None, self.toolbox) for _ in range(self.cfg.group_size)]
        made: list[object | None] = [None] * self.cfg.group_size  # rank 0's environments

        def reset_all() -> list[str | None | Failed]:  # each episode's observation, or why it failed
            observations = []
            for i in range(len(made)):
                try:
                    made[i] = self.environment_factory()
                    observations.append(reset_environment(made[i], row))
                except Exception as e:  # a user's environment must not end the run: the episode is dropped
                    observations.append(Failed(f"{type(e).__name__}: {e}"))
            return observations

        observations = on_main(self.tp, reset_all)  # under tensor parallelism, rank 0's
        episodes = []
        for i, observation in enumerate(observations):
            if isinstance(observation, Failed):
                self._drop(f"environment reset failed ({observation.why})"[:300])
                episodes.append(None)
                continue
            # The other ranks of a tensor-parallel group make the object for its tools' schemas; never reset or call it
            env = made[i] if self.tp is None or self.tp.is_main else self._made_for_schemas()
            box = ToolBox(environment_tools(env) + self.tools, self.tool_cfg, sequential=True)
            episodes.append(self._episode(row, observation, env, box))
        return episodes

    def _made_for_schemas(self) -> object:
        try:
            return self.environment_factory()
        except Exception as e:
            raise RuntimeError(f"environment_factory() raised {type(e).__name__}: {e} on tensor-parallel rank "
                               f"{self.tp.rank} where rank 0's succeeded: the ranks cannot start the same episodes") \
                from e

    def _episode(self, row: dict, observation: str | None, env: object | None, box: ToolBox) -> Episode:
        renderer = ChatRenderer(self.tokenizer, box.schemas, self.system_prompt)
        messages = renderer.messages_of(row["prompt"], observation)
        return Episode(row, messages, renderer.prompt_ids(messages), env, box)

    def _submit(self, episodes: list[Episode], group: _EpisodeGroup) -> None:
        prompt = episodes[0].prompt_ids
        batches = [episodes] if all(ep.prompt_ids == prompt for ep in episodes) else [[ep] for ep in episodes]
        room = self.max_tokens - max(len(ep.prompt_ids) for ep in episodes)
        if room < 1:
            raise ValueError(f"a prompt of {max(len(ep.prompt_ids) for ep in episodes)} tokens leaves no room for a "
                             f"turn in an episode of {self.max_tokens} tokens")
        params = dataclasses.replace(self.params, seed=group_seed(self.seed_rng),
                                     max_new_tokens=min(self.params.max_new_tokens, room))
        for batch in batches:
            more = {"continuable": True} if self.continues else {}
            ids = self.engine.submit(batch[0].prompt_ids, dataclasses.replace(params, n=len(batch)), **more)
            for rid, ep in zip(ids, batch, strict=True):
                self.in_engine[rid] = group
                self.episodes[rid] = ep

    # -- turns ---------------------------------------------------------------------------------------------

    def _land(self, completions: list[Completion]) -> None:
        self.steps += 1
        ended: list[tuple[str, Episode, bool]] = []  # request id, episode, dropped
        calling: list[tuple[Completion, Episode, ParsedTurn]] = []  # turns whose tool calls run now
        answering: list[tuple[Completion, Episode]] = []  # plain turns the environment responds to
        for c in completions:
            ep = self.episodes[c.request_id]
            group = self.in_engine[c.request_id]
            group.group_id = group.group_id or c.group_id
            if c.finish_reason == "abort" or not c.token_ids:
                self.counts["aborted"] += 1
                ended.append((c.request_id, ep, True))
                continue
            ep.add_model_turn(list(c.token_ids), list(c.logprobs), list(c.weight_versions))
            ep.finish_reason = c.finish_reason
            parsed = self._tool_calls(c, ep)
            if parsed is not None and ep.turns < self.episode_cfg.max_turns:
                calling.append((c, ep, parsed))
            elif parsed is None and c.finish_reason == "stop" and responds(ep.environment):
                answering.append((c, ep))
            else:
                ended.append((c.request_id, ep, False))
        if self.episode_cfg.tools_in_background:
            timeout = self.tool_cfg.timeout_s
            for c, ep, parsed in calling:
                reply = in_background(ep.tools.call_many, parsed.calls) if self.runs_tools else None
                self.awaiting[c.request_id] = _Awaiting(c, ep, parsed, reply, self.steps)
            for c, ep in answering:
                reply = in_background(lambda env, text: respond_all([(env, text)], timeout)[0], ep.environment,
                                      ep.last_text) if self.runs_tools else None
                self.awaiting[c.request_id] = _Awaiting(c, ep, None, reply, self.steps)
            self._end(ended)
            return
        # Every episode's calls of this engine step at once: slow tools cost one timeout a step, not one an episode.
        # Under tensor parallelism rank 0 runs them (every rank knows whether this step has any: a collective then).
        def run_calls() -> tuple[list[list[ToolResult]], list[str | None | Failed]]:
            return (_run_all([(ep.tools, parsed.calls) for _, ep, parsed in calling]),
                    respond_all([(ep.environment, ep.last_text) for _, ep in answering], self.tool_cfg.timeout_s))

        t0 = time.perf_counter()
        results, replies = on_main(self.tp, run_calls) if calling or answering else ([], [])
        self.tool_wait_s += time.perf_counter() - t0 if calling or answering else 0.0
        outcomes = [(c, ep, self._next_turn(c, ep, parsed, turn_results))
                    for (c, ep, parsed), turn_results in zip(calling, results, strict=True)]
        outcomes += [(c, ep, self._answer(c, ep, reply)) for (c, ep), reply in zip(answering, replies, strict=True)]
        ended += [(c.request_id, ep, outcome == "dropped") for c, ep, outcome in outcomes if outcome != "continued"]
        self._end(ended)

    def _collect(self, block: bool) -> None:
        """Give the turns whose background tools (or respond) have replied their next turn, once an engine step has
        passed since the turn ended; with ``block`` (the engine has nothing to decode), wait for the first reply
        and take every reply in (bounded: every call returns within its timeout)."""
        if not self.awaiting:
            return
        t0 = time.perf_counter()
        # Under tensor parallelism rank 0's, for every rank (one collective where none is in, most steps)
        replies = on_main(self.tp, lambda: self._replies(block), empty={})
        if block:
            self.tool_wait_s += time.perf_counter() - t0
        ended: list[tuple[str, Episode, bool]] = []
        for rid, reply in replies.items():
            a = self.awaiting.pop(rid)
            outcome = (self._next_turn(a.completion, a.episode, a.parsed, reply) if a.parsed is not None
                       else self._answer(a.completion, a.episode, reply))
            if outcome != "continued":
                ended.append((rid, a.episode, outcome == "dropped"))
        self._end(ended)

    def _replies(self, block: bool) -> dict:
        """The replies that join their episodes now (request id -> reply), on the rank that runs the calls."""
        if block:
            wait([a.reply for a in self.awaiting.values()], return_when=FIRST_COMPLETED)
        return {rid: a.reply.result() for rid, a in self.awaiting.items()
                if a.reply.done() and (block or a.step < self.steps)}

    def _end(self, ended: list[tuple[str, Episode, bool]]) -> None:
        """Free the episodes that ended (request id, episode, dropped), hand them to the scorer, and file those
        scored (``_file``: the dropped ones in their turn)."""
        if not ended:
            return
        if self.continues:
            self.engine.release([rid for rid, _, _ in ended])
        groups = [self.in_engine.pop(rid) for rid, _, _ in ended]  # out of the engine: room to fill
        for rid, _, _ in ended:
            del self.episodes[rid]
        entries = [(g, ep, dropped) for g, (_, ep, dropped) in zip(groups, ended, strict=True)]
        self.scoring.append((entries, self._submit_scoring([(g, ep) for g, ep, dropped in entries if not dropped])))
        self._file_scored()

    def _tool_calls(self, c: Completion, ep: Episode) -> ParsedTurn | None:
        """The turn's tool calls; None where it made none (or was cut, or the episode has no tools)."""
        ep.last_text = decoder(self.tokenizer)(c.token_ids)
        ep.last_ids = list(c.token_ids)
        if c.finish_reason != "stop" or not ep.tools.tools:
            return None
        parsed = parse_tool_calls(ep.last_text, self.tokenizer, ep.tools.schemas)
        return parsed if parsed.calls or parsed.malformed else None  # no call: the model answered

    def _next_turn(self, c: Completion, ep: Episode, parsed: ParsedTurn, results: list[ToolResult]) -> str:
        """Extend the request with the tool replies: "continued", "ended" or "dropped"."""
        ep.tool_calls += len(parsed.calls) + len(parsed.malformed)
        self.counts["tools/errors/malformed"] += len(parsed.malformed)
        for r in results:
            ep.tool_s += r.seconds
            self.counts[f"tools/errors/{r.error}"] += r.error is not None
            self.counts["tools/truncated"] += r.truncated
        # An environment's tool that raised or hung leaves its state unknown: the episode cannot be trusted.
        broken = [r for r in results if r.error in ("exception", "timeout")] if ep.environment is not None else []
        if broken:
            self._drop(broken[0].text)
            return "dropped"
        replies = [{"role": "tool", "name": r.name, "content": r.text} for r in results]
        replies += [{"role": "tool", "content": f"error: {m}"} for m in parsed.malformed]
        return self._extend(c, ep, replies)

    def _answer(self, c: Completion, ep: Episode, reply: str | None | Failed) -> str:
        """Extend the request with the environment's reply to a plain turn, as the next user message."""
        if isinstance(reply, Failed):  # like a raising tool of an environment: its state is unknown
            self._drop(f"environment respond failed ({reply.why})"[:300])
            return "dropped"
        if reply is None or ep.turns >= self.episode_cfg.max_turns:
            return "ended"
        shown = cut(reply, self.tool_cfg.max_result_chars)
        self.counts["tools/truncated"] += shown != reply
        return self._extend(c, ep, [{"role": "user", "content": shown}])

    def _extend(self, c: Completion, ep: Episode, replies: list[dict]) -> str:
        """Continue the request after ``replies`` (context tokens): "continued", or "ended" where they do not fit."""
        messages = ep.messages + [{"role": "assistant", "content": ep.last_text}]
        renderer = ChatRenderer(self.tokenizer, ep.tools.schemas, self.system_prompt)
        delta = renderer.continuation(list(c.prompt_ids) + list(c.token_ids), messages, replies)
        if delta is None:
            self.counts["template_mismatch"] += 1
            return "ended"
        room = self.max_tokens - ep.num_tokens - len(delta)
        if room < 1:
            ep.finish_reason = "length"
            return "ended"
        ep.messages = messages + replies
        ep.add_context(delta)
        params = dataclasses.replace(self.params, n=1, seed=None, max_new_tokens=min(self.params.max_new_tokens, room))
        if self.continues:
            self.engine.extend(c.request_id, delta, params)
        else:
            (rid,) = self.engine.submit(list(ep.prompt_ids) + ep.tokens, params)
            self.in_engine[rid] = self.in_engine.pop(c.request_id)
            self.episodes[rid] = self.episodes.pop(c.request_id)
        return "continued"

    def _no_batch(self) -> str:
        dropped = self.counts["dropped_episodes"]
        why = f"; {dropped} episodes were dropped (an environment's reset, respond or tool raised)" if dropped else ""
        return super()._no_batch() + why

    def _drop(self, why: str) -> None:
        self.counts["dropped_episodes"] += 1
        if self.counts["dropped_episodes"] <= 3:
            log.warning("dropping an episode: %s", why)

    # -- scoring and samples -------------------------------------------------------------------------------

    def _submit_scoring(self, ended: list[tuple[_EpisodeGroup, Episode]]) -> Scoring:
        """The ended episodes' rewards: scored here now, or by the reward workers while the engine decodes on (an
        environment's rewards read its live objects: its scorer is always this process's)."""
        if not ended:
            return Scored([])
        rows = [ep.row for _, ep in ended]
        keys = dict.fromkeys(k for row in rows for k in row if k != "prompt")
        columns = {k: [row.get(k) for row in rows] for k in keys}
        if self.environment_factory is not None:
            columns["environments"] = [ep.environment for _, ep in ended]
        t = time.perf_counter()
        scoring = self.scorer.submit([group.prompt_text for group, _ in ended], [ep.last_text for _, ep in ended],
                                     columns, [ep.last_ids for _, ep in ended])
        self.reward_wait += time.perf_counter() - t
        return scoring

    def _file(self, ended: list[tuple[_EpisodeGroup, Episode, bool]], scoring: Scoring) -> None:
        """File one ``_end``'s episodes with their groups (``scoring``: the rewards of those not dropped)."""
        t = time.perf_counter()
        scored = iter(scoring.result())
        self.reward_wait += time.perf_counter() - t
        for group, ep, dropped in ended:
            group.pending -= 1
            if dropped:
                group.landed.append((ep, None, None))
            else:
                self._file_episode(group, ep, *next(scored))
            if group.pending == 0:
                self._close(group, group.group_id)

    def _file_episode(self, group: _EpisodeGroup, ep: Episode, reward: float | None, parts: dict[str, float]
                      ) -> None:
        group.landed.append((ep, reward, shown(group.prompt_text, ep.last_text, reward, parts, ep.row)
                             | {"turns": ep.turns, "tool_calls": ep.tool_calls}))
        self._record(len(ep.tokens), ep.finish_reason, reward, parts)
        w = self.episode_window
        w["turns"].append(ep.turns)
        w["tool_calls"].append(ep.tool_calls)
        w["tool_s"].append(ep.tool_s)
        model_tokens = sum(ep.mask)
        w["model_tokens"].append(model_tokens)
        w["context_tokens"].append(len(ep.mask) - model_tokens)
        self.gen_tokens += model_tokens

    def _close(self, group: _EpisodeGroup, group_id: str) -> None:
        scored = [(ep, r, record) for ep, r, record in group.landed if r is not None]
        advantages = group_advantages([r for _, r, _ in scored], self.cfg.advantage_eps,
                                      *([self.cfg.scale_rewards] if hasattr(self.cfg, "scale_rewards") else []))
        if advantages is None:
            self.counts["zero_std_groups"] += 1
            return
        self.counts["groups"] += 1
        self.ready += [ep.sample(r, a, group_id, record) for (ep, r, record), a in zip(scored, advantages, strict=True)]

    def _metrics(self, batch, trainer_version, wait_s):
        m = super()._metrics(batch, trainer_version, wait_s)
        w = self.episode_window
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
        m.update({"episode/turns_mean": mean(w["turns"]), "episode/tool_calls_mean": mean(w["tool_calls"]),
                  "episode/tool_s_mean": mean(w["tool_s"]), "episode/model_tokens_mean": mean(w["model_tokens"]),
                  "episode/context_tokens_mean": mean(w["context_tokens"]),
                  "rollout/dropped_episodes": float(self.counts["dropped_episodes"]),
                  "rollout/template_mismatch": float(self.counts["template_mismatch"]),
                  "tools/truncated": float(self.counts["tools/truncated"]),
                  # the loop's wait for tools with nothing to decode: the rollout's time that tools alone took
                  "rollout/tool_wait_s": self.tool_wait_s})
        self.tool_wait_s = 0.0
        for kind in ERROR_KINDS:
            m[f"tools/errors/{kind}"] = float(self.counts[f"tools/errors/{kind}"])
        self.episode_window = {k: [] for k in w}
        return m


def _run_all(batches: list[tuple[ToolBox, list]]) -> list[list[ToolResult]]:
    """``box.call_many(calls)`` of every batch, the batches in threads of their own; results in batch order."""
    results: list[list[ToolResult]] = [[] for _ in batches]

    def run(i: int) -> None:
        box, calls = batches[i]
        try:
            results[i] = box.call_many(calls)
        except Exception as e:  # a bug here must not leave the calls unanswered: the model reads it
            results[i] = [ToolResult(c.name, f"{c.name} could not be run ({type(e).__name__}: {e})"[:300],
                                     "exception") for c in calls]

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i, (_, calls) in enumerate(batches) if calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # bounded: call_many returns within its timeouts
    return results


def _prompt_text(prompt) -> str:
    """What reward functions see as the prompt: the text, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else ""

