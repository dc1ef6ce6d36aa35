"""The scheduler: up to `max_batch` generations at a time, taken from a bounded FIFO queue, each
on one of `max_batch` worker threads with a KV slot of its own; each token is handed to the
asyncio side as it is made (loop.call_soon_threadsafe), as llama.cpp's server hands results from
its slot loop to its HTTP threads. Admission (queue full, draining) is decided here, before any
response header exists.

With max_batch > 1 the engine batches (colibri/batching.py): the running generations' decode
steps share one forward pass, a new request's prompt is prefilled one chunk per step between
them, and each generation's tokens are exactly what it would produce alone. Requests join and
leave between steps. With max_batch 1 one generation runs at a time, with no batching machinery.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from colibri.engine import Engine, Generation
from colibri.errors import ColibriError, EngineFault

log = logging.getLogger("colibri.serve")


class Rejected(Exception):
    """Not admitted: 429 (queue full) or 503 (shutting down), with a Retry-After in seconds."""

    def __init__(self, status: int, reason: str, message: str, retry_after: int):
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


@dataclass
class Started:
    queue_wait_s: float
    slot: int
    reused: int  # prompt tokens the slot already holds (not prefilled)


@dataclass
class Finished:
    generation: Generation
    index: int = 0                # which of the request's n choices ended


@dataclass
class Failed:
    error: Exception


@dataclass
class Job:
    """One generation request. `events` receives Started, then for each of its n choices in turn
    that choice's TokenEvents and its Finished, or a Failed that ends the job.

    The choices run one after another in one slot, so each after the first finds the prompt in
    the KV cache and prefills one token; each gets its own seed (seed + i) and grammar matcher."""

    ids: list[int]
    options: dict                 # engine.stream keywords: max_tokens, temperature, stop, logprobs...;
    #                               "grammar" (a colibri.grammar.Grammar) becomes a fresh matcher per choice
    loop: asyncio.AbstractEventLoop
    slot: int | None = None       # None: the slot with the longest common prefix, else the LRU one
    n: int = 1                    # choices to generate
    request_id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Stats:
    """What /health and /metrics report; written under the scheduler's lock."""

    admitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected_queue_full: int = 0
    rejected_queue_timeout: int = 0
    rejected_draining: int = 0
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0
    completion_tokens: int = 0
    tokens_streamed: int = 0  # counted as each token goes out, not at the end (the dashboard's live tok/s)

    @property
    def rejected(self) -> int:
        return self.rejected_queue_full + self.rejected_queue_timeout + self.rejected_draining


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 8, state_dir: Path | None = None, metrics=None,
                 max_batch: int = 1):
        if not 1 <= max_batch <= len(engine.slots):
            raise ColibriError(f"max_batch must be between 1 and the engine's KV slots ({len(engine.slots)}), "
                               f"not {max_batch}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.state_dir = state_dir
        self.metrics = metrics
        self.stats = Stats()
        self.draining = False
        self.active: list[Job] = []
        self._busy_slots: set[int] = set()
        self._waiting: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._turn_s = 1.0  # moving average of a generation's length, for Retry-After
        self._thread = threading.Thread(target=self._run, name="colibri-scheduler", daemon=True)
        # Persistent workers: a kernel's OpenMP team belongs to the thread that starts it.
        self._workers = ThreadPoolExecutor(max_workers=max_batch, thread_name_prefix="colibri-gen")
        if max_batch > 1:
            engine.start_batching()

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self.draining:
                self.stats.rejected_draining += 1
                raise Rejected(503, "draining", "the server is shutting down; retry on another instance or later",
                               self._retry_after())
            # max_queue counts requests waiting behind the running ones: those about to take a
            # free batch place are not in it
            queued = len(self._waiting) - self._about_to_start()
            if queued >= self.max_queue:
                self.stats.rejected_queue_full += 1
                raise Rejected(429, "queue_full", f"the server is busy: {queued} requests are already waiting "
                               f"(at most {self.max_queue} may); retry later", self._retry_after())
            self._waiting.append(job)
            self.stats.admitted += 1
            self._cv.notify_all()

    def withdraw(self, job: Job, timed_out: bool = False) -> bool:
        """Take a job out of the queue before its turn (its wait timed out, or its client left).
        False when it has already started."""
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            if timed_out:  # the client hears 429: it was never admitted after all
                self.stats.admitted -= 1
                self.stats.rejected_queue_timeout += 1
            else:
                self.stats.cancelled += 1
            return True

    def _about_to_start(self) -> int:
        """Waiting jobs the scheduler thread will start as soon as it runs: one per free batch
        place, among those that ask for no slot or for a different free one each."""
        free_places = self.max_batch - len(self.active)
        if free_places <= 0:
            return 0
        anywhere, slots = 0, set()
        for job in self._waiting:
            if job.slot is None:
                anywhere += 1
            elif job.slot not in self._busy_slots:
                slots.add(job.slot)
        return min(free_places, anywhere + len(slots))

    def retry_after(self) -> int:
        with self._cv:
            return self._retry_after()

    def _retry_after(self) -> int:
        return max(1, min(60, round(self._turn_s * (len(self._waiting) / self.max_batch + 1))))

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def busy_slots(self) -> frozenset[int]:
        """The KV slots generations are running on now."""
        with self._cv:
            return frozenset(self._busy_slots)

    def begin_drain(self) -> None:
        with self._cv:
            self.draining = True

    def idle(self) -> bool:
        with self._cv:
            return not self.active and not self._waiting

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopped = True
            for job in [*self.active, *self._waiting]:
                job.cancel()
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._workers.shutdown(wait=False)
        self.engine.stop_batching()

    # ------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        """Start waiting jobs, in order, while a batch place (and their slot) is free."""
        while True:
            with self._cv:
                while not self._stopped and (len(self.active) >= self.max_batch or self._startable() is None):
                    self._cv.wait()
                if self._stopped:
                    return
                job = self._startable()
                self._waiting.remove(job)
                slot = job.slot if job.slot is not None else self.engine.pick_slot(job.ids, exclude=self._busy_slots)
                self.active.append(job)
                self._busy_slots.add(slot)
            self._workers.submit(self._work, job, slot)

    def _startable(self) -> Job | None:
        """The first waiting job that can start now: one asking for a slot in use waits for it
        (the jobs behind it may go first)."""
        return next((j for j in self._waiting if j.slot is None or j.slot not in self._busy_slots), None)

    def _work(self, job: Job, slot: int) -> None:
        t0 = time.monotonic()
        try:
            self._serve(job, slot)
        except Exception:  # never let one request take the scheduler down
            log.exception("scheduler: request %s failed", job.request_id)
        finally:
            with self._cv:
                self.active.remove(job)
                self._busy_slots.discard(slot)
                self._turn_s = 0.8 * self._turn_s + 0.2 * (time.monotonic() - t0)
                self._cv.notify_all()

    def _serve(self, job: Job, slot: int) -> None:
        if job.cancelled.is_set():  # the client left while it waited
            with self._cv:
                self.stats.cancelled += 1
            return
        engine = self.engine
        wait = time.monotonic() - job.enqueued
        reused = engine.reusable_prefix(slot, job.ids)
        if self.metrics:
            self.metrics.queue_wait.observe(wait)
        self._emit(job, Started(wait, slot, reused))
        outcome, result, scores, last = "completed", None, None, None
        for index in range(job.n):
            options = self._choice_options(job, index, scores)
            outcome, result = self._generate(job, slot, options)
            if outcome != "completed":
                break
            if index == 0 and result.prompt_logprobs is not None:
                scores = result.prompt_logprobs  # the same prompt: scored once for every choice
            result.prompt_logprobs = scores
            self._count(result)
            if self.metrics:
                self.metrics.observe_generation(result)
            last = Finished(result, index)
            if index < job.n - 1:
                self._emit(job, last)  # the last choice's end waits for the slot to be saved
        self._persist(slot)  # every turn end, before the client hears it is done
        with self._cv:
            if outcome == "completed":
                self.stats.completed += 1
            elif outcome == "cancelled":
                self.stats.cancelled += 1
            else:
                self.stats.failed += 1
        if outcome == "completed":
            self._emit(job, last)
        elif outcome == "failed":
            self._emit(job, Failed(result))

    @staticmethod
    def _choice_options(job: Job, index: int, scores) -> dict:
        options = dict(job.options)
        grammar = options.pop("grammar", None)
        if grammar is not None:
            options["constraint"] = grammar.matcher()
        if index and options.get("seed") is not None:
            options["seed"] = (options["seed"] + index) % 2 ** 64
        if index and scores is not None:
            options.pop("prompt_logprobs", None)
        return options

    def _generate(self, job: Job, slot: int, options: dict):
        """One choice: ("completed", Generation), ("cancelled", None) or ("failed", error)."""
        engine = self.engine
        outcome, result = "completed", None
        # The engine polls the flag between prefill chunks too: a client that leaves during a
        # long prompt frees the scheduler within one chunk.
        stream = engine.stream(job.ids, slot=slot, cancel=job.cancelled.is_set, **options)
        try:
            for ev in stream:
                if job.cancelled.is_set():
                    outcome = "cancelled"
                    break
                self._emit(job, ev)
                if ev.token_id is not None:
                    with self._cv:
                        self.stats.tokens_streamed += 1
            else:
                result = engine.last
                if result.finish_reason == "cancelled":
                    outcome = "cancelled"
        except ColibriError as e:
            outcome, result = "failed", e
        except EngineFault as e:  # its message names the damaged file: no traceback needed
            log.error("request %s: %s", job.request_id, e)
            outcome, result = "failed", e
        except Exception as e:
            log.exception("generation failed (request %s)", job.request_id)
            outcome, result = "failed", e
        finally:
            stream.close()  # a cancelled stream leaves the slot holding exactly what was computed
        return outcome, result

    def _count(self, g: Generation) -> None:
        with self._cv:
            self.stats.prompt_tokens += g.prompt_tokens
            self.stats.prompt_tokens_reused += g.prompt_tokens_reused
            self.stats.completion_tokens += g.completion_tokens

    def _emit(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            job.cancel()

    def _persist(self, slot: int) -> None:
        if self.state_dir is None:
            return
        try:
            self.engine.save_slot(slot, slot_path(self.state_dir, slot))
        except Exception:
            log.exception("could not save KV slot %d to %s", slot, self.state_dir)

    # ------------------------------------------------------------------ start-up
    def restore(self) -> list[int]:
        """Load every slot saved in the state directory; returns the tokens each now holds.
        A damaged or foreign file is reported and that slot starts empty."""
        held = []
        for i in range(len(self.engine.slots)):
            path = slot_path(self.state_dir, i) if self.state_dir else None
            n = 0
            if path is not None and path.exists():
                try:
                    n = self.engine.load_slot(i, path)
                except ColibriError as e:
                    log.warning("KV slot %d starts empty: %s", i, e)
            held.append(n)
        return held


def slot_path(state_dir: Path, slot: int) -> Path:
    return Path(state_dir) / f"slot-{slot}.npz"
