"""Continuous batching in the engine (colibri/batching.py): generations running at the same time
share forward passes, and each one's tokens are exactly what it produces alone (greedy, seeded
sampling, drafts); a damaged expert fails only the generation that reads it."""
import threading
from pathlib import Path

import numpy as np
from tools import synthetic_moe

from colibri import Engine
from colibri.errors import EngineFault
from colibri.io.container import Container

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
           "Copy exactly: alpha beta gamma delta, alpha beta gamma delta."]
KWARGS = [dict(), dict(temperature=0.8, top_p=0.9, seed=3), dict(speculative="ngram"), dict(top_k=20, temperature=1.0, seed=9)]


def run_together(engine: Engine, jobs: list[tuple], max_tokens: int) -> list:
    """Each job (prompt, kwargs) streamed on its own thread and slot, all at once; a job's
    result is its Generation or the exception it raised."""
    out: list = [None] * len(jobs)
    go = threading.Barrier(len(jobs))

    def work(i, prompt, kw):
        go.wait()
        try:
            out[i] = engine.generate(prompt, max_tokens=max_tokens, slot=i, stop_at_eos=False, **kw)
        except Exception as e:  # noqa: BLE001 - the test looks at what each job got
            out[i] = e

    threads = [threading.Thread(target=work, args=(i, p, kw)) for i, (p, kw) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_concurrent_generations_equal_their_solo_runs(smollm2_container):
    engine = Engine.load(smollm2_container, kv_slots=4)
    jobs = list(zip(PROMPTS, KWARGS))
    alone = []
    for i, (p, kw) in enumerate(jobs):
        engine.reset(i)
        alone.append(engine.generate(p, max_tokens=24, slot=i, stop_at_eos=False, **kw).token_ids)
    for i in range(4):
        engine.reset(i)
    engine.start_batching()
    try:
        together = run_together(engine, jobs, 24)
        stats = engine.batch_stats
    finally:
        engine.stop_batching()
    assert [g.token_ids for g in together] == alone
    assert stats["mean_rows"] > 1.5  # the steps really were shared


def test_a_damaged_expert_fails_only_the_generation_that_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
    model = synthetic_moe.write_container(tmp_path / "m", "tiny", progress=False)
    layer = "model.layers.1.mlp"
    c = Container(model)
    per_layer = sum(layout.blob_bytes for layout in c.expert_layouts.values())
    budget = (c.dense_bytes + per_layer) / (1 << 30)  # room for one layer's experts: most reads go to disk
    probe = Engine.load(model, stream_experts=True, ram_gb=budget)
    rng = np.random.default_rng(0)
    prompts, used = [], []
    for _ in range(12):  # prompts and the experts of `layer` each one's 4 tokens use
        p = rng.integers(0, 49152, 6).tolist()
        before = np.array(probe.experts.routing_counts()[layer])
        probe.reset()
        probe.generate(p, max_tokens=4, stop_at_eos=False)
        prompts.append(p)
        used.append(set(np.flatnonzero(np.array(probe.experts.routing_counts()[layer]) - before)))
    victim = next(e for e in range(8) if any(e in u for u in used) and any(e not in u for u in used))
    hit = next(p for p, u in zip(prompts, used) if victim in u)
    clean = next(p for p, u in zip(prompts, used) if victim not in u)
    probe.reset()
    clean_tokens = probe.generate(clean, max_tokens=4, stop_at_eos=False).token_ids

    path, offset, _ = Container(model).expert_range(layer, victim)
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xff" * 8)
    engine = Engine.load(model, kv_slots=2, stream_experts=True, ram_gb=budget)
    engine.start_batching()
    try:
        bad, good = run_together(engine, [(hit, {}), (clean, {})], 4)
    finally:
        engine.stop_batching()
    assert isinstance(bad, EngineFault) and f"expert {victim} of {layer}" in str(bad)
    assert not isinstance(good, Exception) and good.token_ids == clean_tokens


def test_batching_starts_and_stops_cleanly(smollm2_container):
    engine = Engine.load(smollm2_container)
    engine.start_batching()
    engine.start_batching()  # idempotent
    g = engine.generate("Hi", max_tokens=3)
    engine.stop_batching()
    assert len(g.token_ids) == 3 and engine.batch_stats is None
    assert Path(smollm2_container).exists()


def test_a_steps_rows_come_in_the_same_order_whatever_order_they_arrive_in(smollm2_container):
    """The rows of a step are ordered by their caches, not by arrival, so the model's per-layer
    K/V lists (DecoderModel._kv_lists) are kept from step to step instead of rebuilt."""
    import time

    engine = Engine.load(smollm2_container, kv_slots=2)
    model = engine.model
    caches = [model.new_cache(16) for _ in range(2)]
    seen = []
    forward_rows = model.forward_rows

    def spy(ids, cs):  # the real pass, recording the order of its caches
        seen.append([caches.index(c) for c in cs])
        return forward_rows(ids, cs)

    model.forward_rows = spy
    engine.start_batching()
    batcher = engine._batcher
    batcher.GATHER_S = 5.0  # a step waits for both rows, however late the second one comes
    try:
        for first in (0, 1, 0, 1):
            batcher.join(), batcher.join()

            def row(i, delay):
                time.sleep(delay)
                batcher.rows([7], [caches[i]])
                batcher.leave()

            threads = [threading.Thread(target=row, args=(i, 0.0 if i == first else 0.3)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    finally:
        engine.stop_batching()
    assert len(seen) == 4 and all(order == seen[0] for order in seen)
    kept = model._kv_memo
    assert kept is not None and [c for c, _ in kept[0]] == [caches[i] for i in seen[0]]


def test_a_fault_outside_any_requests_pass_fails_the_step_not_the_batcher(smollm2_container):
    """An error the per-request handling does not catch (a bug in the step itself) is raised in
    the generations of that step; the batcher's thread lives on and serves the next step, where
    dying would have left every waiting generation blocked forever."""
    engine = Engine.load(smollm2_container)
    model = engine.model
    cache = model.new_cache(16)
    engine.start_batching()
    batcher = engine._batcher
    try:
        real = batcher._run_rows
        batcher._run_rows = lambda reqs: (_ for _ in ()).throw(TypeError("a step bug (test)"))
        got: list = []
        t = threading.Thread(target=lambda: got.append(_outcome(lambda: batcher.rows([7], [cache]))))
        t.start()
        t.join(60)
        assert not t.is_alive() and isinstance(got[0], TypeError)
        batcher._run_rows = real
        rows = batcher.rows([7], [cache])  # the next step runs
        assert rows.shape == (1, engine.vocab_size)
    finally:
        engine.stop_batching()


def _outcome(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the test looks at what the call raised
        return e
