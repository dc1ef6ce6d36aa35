"""Continuous batching: the forward passes of several concurrent generations, run together.

Each generation runs Engine.stream in its own thread, exactly as it would alone; every forward
pass it needs (a decode step, drafted rows to check, a prefill chunk) goes to the StepBatcher,
and the thread waits for its logits. The batcher's thread runs one step at a time:

- every decode row waiting, of every generation, in one DecoderModel.forward_rows pass (a
  speculating generation's drafts are made first, on this thread: an MTP draft is a pass of
  the model's MTP layer, which must not run beside the step on another thread). Each
  row gets the same bits as decoding it alone, so a sequence's tokens never depend on what
  else shares its steps (batch invariance); what the rows share is reading each layer's
  weights once and each routed expert once (the union of the rows' experts);
- then at most one prefill chunk, so a new prompt delays the running streams by one chunk per
  step at most, and its generation joins the decode rows when its prompt is in.

A step starts as soon as every registered generation is waiting (nothing more can join it),
or GATHER_S after the first request of the step arrived: a generation busy sampling or
sending its token does not hold the others back for long.

Faults stay with their request: when a step fails (an expert file that fails its checksum,
say), each of its requests is run again alone, so only the one that reads the damaged expert
fails. Rerunning is safe: a forward writes the same K/V at the same positions again.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from colibri.kernels.cpu import TILE_A

# Of the memory available at start, the share the batch's KV caches may grow into at full context.
KV_MEMORY_SHARE = 0.5


def default_max_batch(kv_bytes_per_slot: int, available_bytes: int) -> int:
    """`serve --max-batch` when not given: one tile of the multi-row kernels (TILE_A rows each
    unpack the weights once; a row past the tile starts another, and measured 0.40 of a step
    where rows inside it cost 0.35: docs/benchmarks.md: Several clients at once), fewer when that many
    full-context KV caches would take more than KV_MEMORY_SHARE of the memory available."""
    by_memory = int(available_bytes * KV_MEMORY_SHARE // max(kv_bytes_per_slot, 1))
    return max(1, min(TILE_A, by_memory))


class _Request:
    __slots__ = ("tokens", "caches", "chunk", "all_logits", "draft", "done", "result", "hidden", "error")

    def __init__(self, tokens: list[int], caches: list, chunk: bool = False, all_logits: bool = False,
                 draft: Callable[[], list[int]] | None = None):
        self.tokens, self.caches, self.chunk, self.all_logits = tokens, caches, chunk, all_logits
        self.draft = draft  # rows: called on the batcher's thread; its tokens follow `tokens` in the step
        self.done, self.result, self.hidden, self.error = False, None, None, None


class StepBatcher:
    GATHER_S = 0.002

    def __init__(self, model, before_step: Callable[[], None] | None = None):
        self.model = model
        self._before_step = before_step  # e.g. the engine's kernel-thread policy, applied on this thread
        self._cv = threading.Condition()
        self._members = 0
        self._pending: list[_Request] = []
        self._stopped = False
        self.steps = 0          # steps run
        self.rows_run = 0       # decode rows run (a step's batch size, summed)
        self._thread = threading.Thread(target=self._run, name="colibri-batch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ generation threads
    def join(self) -> None:
        """A generation starts: steps wait for it (up to GATHER_S) from now on."""
        with self._cv:
            self._members += 1

    def leave(self) -> None:
        with self._cv:
            self._members -= 1
            self._cv.notify_all()

    def rows(self, tokens: list[int], caches: list) -> np.ndarray:
        """DecoderModel.forward_rows(tokens, caches), run in the next step with other rows."""
        return self._submit(_Request(list(tokens), list(caches)))

    def drafted_rows(self, tok: int, cache, draft: Callable[[], list[int]]) -> tuple[list[int], np.ndarray, np.ndarray]:
        """One speculating generation's pass: draft() runs on the batcher's thread at the start of
        the next step, then [tok, *drafts] in one cache go through forward_rows with the other
        rows. -> (drafts, their logits rows, the model's final hidden states for them)."""
        req = _Request([tok], [cache], draft=draft)
        rows = self._submit(req)
        return req.tokens[1:], rows, req.hidden

    def chunk(self, ids: list[int], cache, all_logits: bool = False) -> np.ndarray:
        """DecoderModel.forward(ids, cache, all_logits), run as the prefill chunk of a step."""
        return self._submit(_Request(list(ids), [cache], chunk=True, all_logits=all_logits))

    def _submit(self, req: _Request) -> np.ndarray:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the step batcher has stopped")
            self._pending.append(req)
            self._cv.notify_all()
            while not req.done:
                self._cv.wait()
        if req.error is not None:
            raise req.error
        return req.result

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            for r in self._pending:
                r.error, r.done = RuntimeError("the step batcher has stopped"), True
            self._pending.clear()
            self._cv.notify_all()

    # ------------------------------------------------------------------ the batcher's thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                deadline = time.monotonic() + self.GATHER_S
                while len(self._pending) < self._members and not self._stopped:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                decode = [r for r in self._pending if not r.chunk]
                waiting_chunks = [r for r in self._pending if r.chunk]
                chunks, self._pending = waiting_chunks[:1], waiting_chunks[1:]
                taken = decode + chunks
            if self._before_step is not None:
                self._before_step()
            # Rows in a fixed order of their caches, not of arrival: the model keeps the per-layer
            # lists of the rows' K/V arrays while a step's caches come in the same order; by
            # arrival they would be rebuilt at most steps.
            try:
                decode = sorted((r for r in decode if self._draft(r)), key=lambda r: id(r.caches[0]))
                if decode:
                    self._run_rows(decode)
                for r in chunks:
                    self._run_one(r)
            except Exception as e:  # noqa: BLE001 - a fault outside any one request's pass: fail
                for r in taken:    # the step's requests rather than the thread (they would wait forever)
                    if r.error is None and r.result is None:
                        r.error = e
            with self._cv:
                self.steps += 1
                self.rows_run += sum(len(r.tokens) for r in decode)
                for r in taken:
                    r.done = True
                self._cv.notify_all()

    @staticmethod
    def _draft(r: _Request) -> bool:
        """Add a request's drafts to its rows (False: drafting failed, the request has its error)."""
        if r.draft is None:
            return True
        try:
            drafts = r.draft()
        except Exception as e:  # noqa: BLE001 - it belongs to this request alone
            r.error = e
            return False
        r.tokens += drafts
        r.caches += r.caches[:1] * len(drafts)
        return True

    def _run_rows(self, reqs: list[_Request]) -> None:
        if len(reqs) == 1:
            self._run_one(reqs[0])
            return
        try:
            out = self.model.forward_rows([t for r in reqs for t in r.tokens], [c for r in reqs for c in r.caches])
        except Exception:  # find the request the fault belongs to: each again, alone
            for r in reqs:
                self._run_one(r)
            return
        hidden = self.model.rows_hidden
        at = 0
        for r in reqs:
            r.result = out[at : at + len(r.tokens)]
            if r.draft is not None:
                r.hidden = np.array(hidden[at : at + len(r.tokens)])
            at += len(r.tokens)

    def _run_one(self, r: _Request) -> None:
        try:
            if r.chunk:
                r.result = self.model.forward(np.asarray(r.tokens, dtype=np.int64), r.caches[0], all_logits=r.all_logits)
            else:
                r.result = self.model.forward_rows(r.tokens, r.caches)
                if r.draft is not None:
                    r.hidden = np.array(self.model.rows_hidden)
        except Exception as e:
            r.error = e
