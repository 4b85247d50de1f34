"""Reward functions run in worker processes beside the rollout loop (``rollout.reward_workers``).

Scoring a GRPO step's 64 completions with math-verify takes ~0.2 s of a CPU core (``bench/reward_cost.py``), which
the single-turn loop spends between engine steps while the GPU waits. With workers the loop hands each engine
step's completions to them and steps the engine on; it files the rewards when they come back, in the order the
completions landed, so the batches hold what inline scoring would give them. The multi-turn loop hands
them its ended episodes the same way, and the evaluation each engine step's completions. A synchronous ``score``
(tensor parallelism's rank 0) splits its completions over the workers instead.

A worker is a fresh interpreter (``python -m unison.rollout.reward_workers``), not a fork of the trainer: it holds
no CUDA context and no other thread's locks, and never runs the trainer's script again (which multiprocessing's
spawn does to a script without a ``__main__`` guard). The reward functions therefore travel pickled: those defined
in the script that runs (``__main__``), and those that do not pickle, score inline, and the log says so.
A worker that dies or outlives ``timeout_s`` on one batch costs that batch's rewards (counted as each function's
failures, as an exception would be), never the run; a new worker takes its place. A batch's clock starts when its
worker has loaded the functions. One that cannot load them at all, or not within ``timeout_s``, turns scoring
inline for the rest of the run.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

log = logging.getLogger(__name__)


class _Chunk:
    """Consecutive completions of one submitted call, scored by one worker."""

    def __init__(self, call):
        self.call = call
        self.values: list | None = None  # per reward function: a value per completion

    def fail(self, why: str, n_fns: int) -> None:
        from .rewards import _Failed
        self.values = [[_Failed(why)] * len(self.call.completions) for _ in range(n_fns)]


class _Worker:
    def __init__(self, payload: bytes):
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(child_read), str(child_write)],
                                     pass_fds=(child_read, child_write), env=env)
        os.close(child_read)
        os.close(child_write)
        self.inbox, self.outbox = Connection(parent_read, writable=False), Connection(parent_write, readable=False)
        self.outbox.send(payload)
        self.ready = False  # the worker loaded the reward functions
        self.chunk: _Chunk | None = None
        self.started = self.since = time.monotonic()  # since: when it could start on its chunk

    def stop(self, kill: bool = False) -> None:
        for conn in (self.inbox, self.outbox):
            conn.close()  # a worker reads EOF and exits
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RewardWorkers:
    """``n`` worker processes that score calls for a ``RewardScorer``; ``inline(call)`` (the scorer's own
    ``_all_values``) scores a chunk here where the workers cannot. The workers start at once, so that they have
    loaded the functions (math-verify and SymPy take a second) by the time the first completions land."""

    def __init__(self, reward_fns: list, n: int, timeout_s: float, inline):
        if n < 1:
            raise ValueError(f"reward workers must be >= 1, got {n}")
        self.n_fns, self.n, self.timeout_s, self.inline = len(reward_fns), n, timeout_s, inline
        self.payload = pickle.dumps(reward_fns)  # raises where one does not pickle: the caller scores inline
        self.slots: list[_Worker | None] = [None] * n
        self.waiting: deque[_Chunk] = deque()
        self.broken: str | None = None  # why the workers cannot score: everything inline from then on
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _stop_all, self.slots)
        self._start()

    def submit(self, call, tally) -> Pending:
        """Score ``call`` in up to ``n`` chunks; ``tally(values)`` turns the values into the scorer's results."""
        k = min(self.n, len(call.completions)) or 1
        bounds = [len(call.completions) * i // k for i in range(k + 1)]
        chunks = [_Chunk(call.slice(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
        self.waiting.extend(chunks)
        self.progress(0.0)
        return Pending(self, chunks, tally)

    def progress(self, timeout: float) -> None:
        """File what the workers sent (waiting up to ``timeout`` s for something where nothing has come), stop
        those past ``timeout_s``, hand waiting chunks to idle workers."""
        busy = {w.inbox: w for w in self.slots if w is not None}
        for conn in wait(list(busy), timeout) if busy else ():
            w = busy[conn]
            while w in self.slots and self._receive(w) and w in self.slots and w.inbox.poll():
                pass  # everything it sent so far (an exit after its last results included)
        now = time.monotonic()
        for i, w in enumerate(self.slots):
            if w is None or w.chunk is None:
                continue
            if not w.ready:  # loading the functions has timeout_s of its own; a batch's clock starts after it
                if now - w.started > self.timeout_s:
                    self._break(f"a reward worker did not load the reward functions in {self.timeout_s:g} s "
                                "(rollout.reward_timeout_s)")
                continue
            if now - w.since > self.timeout_s:
                w.chunk.fail(f"the reward worker took more than {self.timeout_s:g} s (rollout.reward_timeout_s) "
                             "on this batch and was stopped", self.n_fns)
                log.warning("a reward worker took more than %g s on %d completions: stopped, a new one starts",
                            self.timeout_s, len(w.chunk.call.completions))
                w.stop(kill=True)
                self.slots[i] = None
        self._dispatch()

    def close(self) -> None:
        self._finalizer()

    def _receive(self, w: _Worker) -> bool:
        """File one message of ``w``; False where it turned out to have exited."""
        try:
            msg = w.inbox.recv()
        except (EOFError, OSError):
            self._died(w)
            return False
        if msg[0] == "ready":
            w.ready, w.since = True, time.monotonic()  # a chunk sent before: its clock starts now
        elif msg[0] == "error":  # the functions do not load there: this run scores inline
            self._break(f"a reward worker could not load the reward functions ({msg[1]})")
        else:
            chunk, w.chunk = w.chunk, None
            if msg[0] == "done":
                chunk.values = msg[1]
            else:  # "failed": the call itself did not get through (a column that does not unpickle there)
                chunk.fail(msg[1], self.n_fns)
        return True

    def _died(self, w: _Worker) -> None:
        code = w.proc.wait()
        self.slots[self.slots.index(w)] = None
        w.stop()
        if not w.ready:
            if w.chunk is not None:
                self.waiting.appendleft(w.chunk)
            self._break(f"a reward worker exited (code {code}) before it loaded the reward functions")
            return
        self.restarts += 1
        if w.chunk is not None:
            w.chunk.fail(f"the reward worker exited (code {code}) while scoring this batch", self.n_fns)
            log.warning("a reward worker exited (code %d) while scoring %d completions: their rewards are lost, a "
                        "new worker starts", code, len(w.chunk.call.completions))

    def _break(self, why: str) -> None:
        if self.broken is None:
            log.warning("%s: scoring inline from now on", why)
        self.broken = why
        for i, w in enumerate(self.slots):
            if w is not None:
                if w.chunk is not None:
                    self.waiting.appendleft(w.chunk)
                w.stop(kill=True)
                self.slots[i] = None

    def _start(self) -> None:
        """A worker in each empty slot."""
        for i, w in enumerate(self.slots):
            if w is None and self.broken is None:
                try:
                    self.slots[i] = _Worker(self.payload)
                except OSError as e:  # no process to be had (out of file descriptors, memory)
                    self._break(f"a reward worker could not start ({type(e).__name__}: {e})")

    def _dispatch(self) -> None:
        if self.waiting:
            self._start()
        if self.broken is not None:
            while self.waiting:
                chunk = self.waiting.popleft()
                chunk.values = self.inline(chunk.call)
            return
        for w in self.slots:
            if not self.waiting:
                return
            if w.chunk is None:
                chunk = self.waiting.popleft()
                try:
                    data = pickle.dumps(("score", chunk.call.fields()))
                except Exception as e:  # a column that does not pickle (its objects' errors vary)
                    chunk.values = self.inline(chunk.call)
                    log.debug("scored a batch inline: its columns do not pickle (%s)", e)
                    continue
                try:
                    w.outbox.send_bytes(data)
                except OSError:
                    self.waiting.appendleft(chunk)  # the worker is gone: the next progress() files its exit
                    continue
                w.chunk = chunk
                if w.ready:
                    w.since = time.monotonic()


class Pending:
    """A submitted call's results, once every chunk is back (``done``); ``result`` waits for them."""

    def __init__(self, workers: RewardWorkers, chunks: list[_Chunk], tally):
        self.workers, self.chunks, self.tally = workers, chunks, tally
        self._result = None

    def done(self) -> bool:
        if self._result is None and any(c.values is None for c in self.chunks):
            self.workers.progress(0.0)
        return self._result is not None or all(c.values is not None for c in self.chunks)

    def result(self) -> list:
        while self._result is None and any(c.values is None for c in self.chunks):
            self.workers.progress(1.0)
        if self._result is None:
            per_fn = [[v for c in self.chunks for v in c.values[k]] for k in range(self.workers.n_fns)]
            self._result = self.tally(per_fn)
        return self._result


def _stop_all(slots: list[_Worker | None]) -> None:
    for i, w in enumerate(slots):
        if w is not None:
            w.stop()
            slots[i] = None


def _serve(read_fd: int, write_fd: int) -> None:
    """A worker's life: load the reward functions, then score each call the loop sends until it closes the pipe."""
    from .rewards import RewardScorer, _Call
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; EOF ends this process
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        scorer = RewardScorer([(fn, 1.0) for fn in pickle.loads(inbox.recv())])  # the loop applies the weights
    except EOFError:
        return
    except Exception as e:  # a function whose module does not import here
        outbox.send(("error", f"{type(e).__name__}: {e}"[:300]))
        return
    outbox.send(("ready",))
    parent = os.getppid()
    while True:
        if not inbox.poll(5.0):
            if os.getppid() != parent:  # the trainer is gone (a process it forked may hold the pipe open)
                return
            continue
        try:
            msg = inbox.recv()
        except EOFError:
            return
        except Exception as e:
            outbox.send(("failed", f"the batch did not reach the reward worker ({type(e).__name__}: {e})"[:300]))
            continue
        outbox.send(("done", scorer._all_values(_Call(*msg[1]))))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
