"""colibri/cluster: routed experts on Ray actors give the single-process engine's tokens, and
its logits to float32 rounding (see _same_logits) (MoE families, placements, worker budgets,
batched rows), a worker killed or
stopped mid-generation changes nothing but a fault counter, and the local cluster listens on
loopback only. A real Ray instance on 127.0.0.1, shared by the whole module; no mocks."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from colibri import generate as gen
from colibri.engine import Engine

from cluster_models import FAMILIES, HF_FAMILIES, HF_VOCAB  # fixtures `models`, `hf_models`: conftest.py

PROMPT = np.random.default_rng(1).integers(0, HF_VOCAB, size=24).tolist()


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module, started the way --cluster local starts it."""
    try:
        import ray
    except ImportError:
        pytest.skip("ray is not installed (pip install 'colibri[cluster]')")
    from colibri.cluster.head import connect

    try:
        connect("local")
    except Exception as e:  # a sandbox without the sockets or shared memory Ray needs
        pytest.skip(f"a local Ray instance could not start here: {e}")
    yield ray
    ray.shutdown()


def _run(engine):
    """(greedy tokens after an 8-token prompt, final logits of 16 forced tokens decoded one by
    one after a 4-token prefill)."""
    tokens = engine.generate(PROMPT[:8], max_tokens=6, stop_at_eos=False).token_ids
    engine.reset()
    cache = engine.slots[0].cache
    gen.prefill(engine.model, cache, PROMPT[:4])
    for tok in PROMPT[4:-1]:
        gen.decode_one(engine.model, cache, tok)
    return tokens, gen.decode_one(engine.model, cache, PROMPT[-1])


def _cluster(model, **options):
    return Engine.load(model, max_context=64, cluster="local", **options)


def _single(model, **options):
    return Engine.load(model, max_context=64, stream_experts=False, **options)


def _same_logits(a, b):
    """Equal to float32 rounding. Bit for bit whenever the head and the workers run kernels from
    numba's cache; but a first start (kernels compiled in this process) and a cached start of
    the very same single-process engine already differ in the last bit of some logits
    (<= 2.4e-7 on these models), and the workers compile in processes of their own, so the
    suite, which starts from an empty cache on CI, checks the values to that rounding."""
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _same(a, b):
    assert a[0] == b[0]  # the greedy tokens themselves: identical
    _same_logits(a[1], b[1])


def _same_as_one_process(model, workers: int = 2) -> None:
    reference = _run(_single(model))
    engine = _cluster(model, expert_workers=workers)
    try:
        _same(_run(engine), reference)
        assert engine.experts.faults == 0
        assert engine.experts.transport.layers > 0
    finally:
        engine.experts.close()


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_cluster_tokens_are_the_single_process_bits(ray_cluster, models, preset):
    _same_as_one_process(models[preset])


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_cluster_tokens_on_the_other_moe_families(ray_cluster, hf_models, family):
    """Mixtral, Qwen2-MoE (its shared expert and dense layer stay at the head) and GLM-5's
    MoE-DSA: the cluster gives one process's tokens on every MoE family of the suite."""
    _same_as_one_process(hf_models[family], workers=3 if family == "glm_moe_dsa" else 2)


def test_int8_activations_and_three_balanced_workers(ray_cluster, models):
    """The activation mode reaches the workers, and a heat-balanced placement over three workers
    (from a routing history file as a streaming run leaves it) changes nothing either."""
    import json

    from colibri.default_model import history_path
    from colibri.io.container import Container

    model = models["qwen3-30b-a3b"]
    reference = _run(_single(model, activations="int8"))
    rng = np.random.default_rng(2)
    heat = {p: rng.integers(0, 100, l.num_experts).tolist() for p, l in Container(model).expert_layouts.items()}
    history = history_path(model)
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text(json.dumps({"version": 1, "counts": heat}))
    try:
        engine = _cluster(model, expert_workers=3, expert_placement="balanced", activations="int8")
    finally:
        history.unlink()
    try:
        _same(_run(engine), reference)
        for prefix, owners in engine.experts.placement.owner.items():
            hottest = sorted(range(len(owners)), key=lambda e: (-heat[prefix][e], e))[:3]
            assert sorted(owners[e] for e in hottest) == [0, 1, 2]  # the three hottest on three workers
    finally:
        engine.experts.close()


def test_batched_rows_are_each_rows_own_tokens(ray_cluster, models):
    """forward_rows (the server's batching) through the cluster: each row's logits are what it
    gets alone in one process."""
    model = models["olmoe-1b-7b"]
    single, engine = _single(model), _cluster(model, expert_workers=2)
    try:
        rows = []
        for e in (single, engine):
            caches = [e.model.new_cache(64) for _ in range(3)]
            for i, c in enumerate(caches):
                gen.prefill(e.model, c, PROMPT[i:i + 5])
            rows.append(e.model.forward_rows(PROMPT[10:13], caches))
        _same_logits(rows[0], rows[1])
    finally:
        engine.experts.close()


def test_shards_under_a_budget_stream_then_hit(ray_cluster, models):
    """Workers whose budget holds less than their shard stream it through their own store (the
    same tokens); workers that hold their shard serve every expert from RAM: after the first
    turn, hit rate 1.0 and no disk reads."""
    model = models["olmoe-1b-7b"]
    reference = _run(_single(model))
    shard_gb = Engine.load(model, max_context=8, stream_experts=False).container.expert_bytes / 2 / 2**30
    squeezed = _cluster(model, expert_workers=2, worker_ram_gb=shard_gb / 3)
    try:
        _same(_run(squeezed), reference)
        assert squeezed.expert_stats["misses"] > 0
    finally:
        squeezed.experts.close()
    held = _cluster(model, expert_workers=2)
    try:
        _run(held)
        before = held.expert_stats
        g = held.generate(PROMPT[:8], max_tokens=6, stop_at_eos=False)
        after = held.expert_stats
        assert g.experts["hit_rate"] == 1.0 and g.experts["hits"] > 0
        assert after["reads"] == before["reads"] == 0
    finally:
        held.experts.close()


def _wait_serving(experts, index: int, timeout: float = 120.0) -> int:
    """The restarted worker's pid once it serves again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if experts._usable(experts.workers[index]):
            return experts.worker_pids[index]
        time.sleep(0.2)
    raise AssertionError(f"worker {index} did not come back within {timeout} s")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_worker_lost_mid_generation_changes_nothing(ray_cluster, models, how):
    """A worker killed (SIGKILL: Ray reports it dead) or frozen (SIGSTOP: it never answers, the
    deadline passes) after the third token: the head computes its experts, the request
    finishes with the single-process tokens, the fault is counted and the worker restarted."""
    model = models["qwen3-30b-a3b"]
    single = _single(model)
    expected = single.generate(PROMPT[:8], max_tokens=12, stop_at_eos=False).token_ids
    engine = _cluster(model, expert_workers=2)
    experts = engine.experts
    experts.deadline_s = 2.0
    victim = experts.worker_pids[1]
    try:
        tokens, hits_at_fault = [], None
        for ev in engine.stream(PROMPT[:8], max_tokens=12, stop_at_eos=False):
            if ev.token_id is not None:
                tokens.append(ev.token_id)
            if len(tokens) == 3 and experts.faults == 0 and experts.worker_pids[1] == victim:
                hits_before = engine.expert_stats["hits"]
                os.kill(victim, getattr(signal, how))
            elif experts.faults == 1 and hits_at_fault is None:
                hits_at_fault = engine.expert_stats["hits"]
        assert tokens == expected
        assert engine.last.finish_reason == "length"
        assert experts.faults == 1
        assert hits_at_fault >= hits_before  # a counter: the lost worker's figures are kept
        assert _wait_serving(experts, 1) != victim
        engine.reset()
        assert engine.generate(PROMPT[:8], max_tokens=12, stop_at_eos=False).token_ids == expected
        assert experts.faults == 1 and experts.transport.local_s > 0
    finally:
        experts.close()
        try:
            os.kill(victim, signal.SIGKILL)  # the frozen one, should Ray not have reaped it
        except ProcessLookupError:
            pass


def test_local_cluster_listens_on_loopback_only(ray_cluster, models):
    psutil = pytest.importorskip("psutil")
    engine = _cluster(models["qwen3-30b-a3b"], expert_workers=2)
    try:
        ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in ours]
        assert listening, "Ray's servers were not found"
        assert {c.laddr.ip for c in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
        assert set(engine.experts.worker_pids) <= ours
    finally:
        engine.experts.close()


def test_placement_owns_every_expert_once():
    from types import SimpleNamespace

    from colibri.cluster.placement import place
    from colibri.errors import ColibriError

    layout = SimpleNamespace(num_experts=10, blob_bytes=4096)
    container = SimpleNamespace(expert_layouts={"model.layers.0.mlp": layout, "model.layers.1.mlp": layout},
                                dir="m")
    contiguous = place(container, 3)
    assert contiguous.owner["model.layers.0.mlp"] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    heat = {"model.layers.0.mlp": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]}
    balanced = place(container, 2, "balanced", heat)
    assert balanced.owner["model.layers.0.mlp"] == [0, 1, 1, 0, 0, 1, 1, 0, 0, 1]
    assert balanced.owner["model.layers.1.mlp"] == [0] * 5 + [1] * 5  # no history: contiguous
    assert "worker 1: 10 experts" in balanced.describe()
    with pytest.raises(ColibriError, match="between 1 and 10"):
        place(container, 11)
    # Shares from the cluster plan: a worker with three times the budget owns three times the experts.
    weighted = place(container, 2, shares=[0.25, 0.75])
    assert weighted.owner["model.layers.0.mlp"] == [0] * 2 + [1] * 8  # round(10 * 0.25) = 2
    assert place(container, 3, shares=[1, 1, 1]).owner == contiguous.owner
    dealt = place(container, 2, "balanced", heat, shares=[0.25, 0.75]).owner["model.layers.0.mlp"]
    assert dealt.count(0) in (2, 3) and dealt[0] == 0 and dealt[1] == 1  # the hottest on each
    with pytest.raises(ColibriError, match="shares"):
        place(container, 2, shares=[1.0])


def test_cluster_plan_sizes_workers_by_their_nodes_memory():
    """colibri/plan/cluster.py: workers round-robin over the nodes (the head's last), a node's
    usable RAM split between its workers, shares proportional to budgets, fits or not."""
    from colibri.plan.cluster import Node, describe_cluster_plan, plan_cluster

    GB = 1 << 30
    nodes = [Node("10.0.0.1", 64 * GB, head=True), Node("10.0.0.2", 128 * GB), Node("10.0.0.3", 64 * GB)]
    plan = plan_cluster(nodes, 3, expert_bytes=150 * GB, head_bytes=8 * GB)
    assert [w["node"] for w in plan["workers"]] == ["10.0.0.2", "10.0.0.3", "10.0.0.1"]
    b = [w["budget_bytes"] for w in plan["workers"]]
    assert b[0] > b[1] > b[2]  # the big node; a plain one; the head's, less the dense weights
    assert abs(b[1] - int(64 * GB * 0.88)) < GB and abs(b[2] - (b[1] - 8 * GB)) < GB
    assert abs(sum(w["share"] for w in plan["workers"]) - 1) < 1e-9 and plan["fits"]
    assert all(w["expert_bytes"] <= w["budget_bytes"] for w in plan["workers"])  # fits: every shard fits
    assert not plan_cluster(nodes, 3, expert_bytes=400 * GB)["fits"]
    two_on_one = plan_cluster([Node("a", 32 * GB)], 2, expert_bytes=GB)
    assert two_on_one["workers"][0]["budget_bytes"] == two_on_one["workers"][1]["budget_bytes"]
    text = describe_cluster_plan(plan)
    assert "worker 0 on 10.0.0.2" in text and "every shard fits" in text


def test_dashboard_telemetry_sees_the_workers_experts(ray_cluster, models):
    """The heat map the dashboard draws (colibri/serve/telemetry.py) comes from the workers:
    every routed expert counted by its owner, the whole shards resident in their RAM."""
    from colibri.serve.telemetry import expert_cache, tiers

    engine = _cluster(models["olmoe-1b-7b"], expert_workers=2)
    try:
        engine.generate(PROMPT[:8], max_tokens=4, stop_at_eos=False)
        cache = expert_cache(engine)
        layers = engine.container.expert_layouts
        assert [l["prefix"] for l in cache["layers"]] == list(layers)
        for layer in cache["layers"]:
            assert set(layer["places"]) == {"p"}  # no budget: each worker pins its whole shard
            assert sum(layer["counts"]) > 0
        assert cache["hit_rate"] == 1.0
        ram = next(t for t in tiers(engine) if t["tier"] == "ram")
        assert ram["expert_bytes"] == engine.container.expert_bytes
    finally:
        engine.experts.close()


def test_cluster_keeps_the_routing_history_a_streaming_run_keeps(ray_cluster, models):
    """The head counts each layer's routing as one process's store does and saves it at every
    turn end to the model's history file: the next start's hot sets and balanced placement."""
    import json

    from colibri.default_model import history_path

    model = models["deepseek-v3"]
    history = history_path(model)
    history.unlink(missing_ok=True)
    from colibri.io.container import Container

    c = Container(model)
    try:  # a budget that holds a third of the experts: a streaming store, which keeps the history
        streamed = Engine.load(model, max_context=64, stream_experts=True,
                               ram_gb=(c.dense_bytes + c.expert_bytes / 3) / 2**30)
        streamed.generate(PROMPT[:8], max_tokens=6, stop_at_eos=False)
        one_process = json.loads(history.read_text())["counts"]
        history.unlink()
        engine = _cluster(model, expert_workers=2)
        try:
            engine.generate(PROMPT[:8], max_tokens=6, stop_at_eos=False)
            assert json.loads(history.read_text())["counts"] == one_process
            engine.reset()
            engine.generate(PROMPT[:8], max_tokens=6, stop_at_eos=False)  # earlier history + this process
        finally:
            engine.experts.close()
        twice = json.loads(history.read_text())["counts"]
        assert twice == {p: [2 * c for c in counts] for p, counts in one_process.items()}
        assert sum(map(sum, twice.values())) > 0
    finally:
        history.unlink(missing_ok=True)


def test_respawn_delay_doubles_up_to_the_cap():
    from colibri.cluster.head import RESPAWN_BACKOFF_S, respawn_delay

    first, second, cap = RESPAWN_BACKOFF_S
    assert [respawn_delay(n) for n in (1, 2, 3, 4)] == [first, second, 2 * second, 4 * second]
    assert respawn_delay(50) == cap


def test_a_worker_that_cannot_restart_backs_off_and_returns(ray_cluster, models, monkeypatch):
    """A worker killed while its node has lost the container (its manifest gone): each restart
    fails, the next one waits longer (respawn_delay), the head computes the worker's experts
    all along with the single-process tokens; once the container is back the worker returns."""
    from colibri.cluster import head
    from colibri.io.container import MANIFEST

    monkeypatch.setattr(head, "RESPAWN_BACKOFF_S", (0.0, 0.5, 4.0))
    model = models["olmoe-1b-7b"]
    expected = _single(model).generate(PROMPT[:8], max_tokens=8, stop_at_eos=False).token_ids
    engine = _cluster(model, expert_workers=2)
    experts = engine.experts
    spawned, spawn = [], experts._spawn

    def timed_spawn(index, failures=0):
        spawned.append((time.monotonic(), failures))
        return spawn(index, failures)

    monkeypatch.setattr(experts, "_spawn", timed_spawn)
    manifest = Path(model) / MANIFEST
    hidden = manifest.with_name(MANIFEST + ".away")
    manifest.rename(hidden)
    try:
        os.kill(experts.worker_pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while experts.faults < 4 and time.monotonic() < deadline:
            engine.reset()
            assert engine.generate(PROMPT[:8], max_tokens=8, stop_at_eos=False).token_ids == expected
        assert experts.faults >= 4, f"only {experts.faults} faults in 90 s"
    finally:
        hidden.rename(manifest)
    try:
        _wait_serving(experts, 1)
        # Restarts after the first came at least respawn_delay(failures) after the one before.
        assert [f for _, f in spawned[:4]] == [1, 2, 3, 4]
        for (t0, _), (t1, failures) in zip(spawned, spawned[1:4]):
            assert t1 - t0 >= head.respawn_delay(failures)
        engine.reset()
        assert engine.generate(PROMPT[:8], max_tokens=8, stop_at_eos=False).token_ids == expected
        assert experts.workers[1].failures == 0  # it served: the next fault restarts it at once
    finally:
        experts.close()


def test_a_restarted_head_adopts_its_workers(ray_cluster, models):
    """A head that goes away without closing (its connections dropped, as when its process
    dies) leaves its workers running; the next head with the same model and placement adopts
    them, shards already loaded, with the same tokens. Another placement starts its own."""
    model = models["olmoe-1b-7b"]
    expected = _single(model).generate(PROMPT[:8], max_tokens=8, stop_at_eos=False).token_ids
    first = _cluster(model, expert_workers=2)
    pids = first.experts.worker_pids
    assert first.generate(PROMPT[:8], max_tokens=8, stop_at_eos=False).token_ids == expected
    for w in first.experts.workers:  # the process "dies": its sockets close, nothing else happens
        w.link.close()
    second = _cluster(model, expert_workers=2)
    try:
        assert second.experts.adopted == 2 and second.experts.worker_pids == pids
        assert all(w.link is not None for w in second.experts.workers)  # the wire, with the new secret
        assert second.generate(PROMPT[:8], max_tokens=8, stop_at_eos=False).token_ids == expected
        assert second.experts.faults == 0
        other = _cluster(model, expert_workers=2, expert_placement="balanced", worker_ram_gb=0.001)
        try:
            assert other.experts.adopted == 0 and not set(other.experts.worker_pids) & set(pids)
        finally:
            other.experts.close()
    finally:
        second.experts.close()


def test_a_worker_without_a_head_exits(ray_cluster, models):
    """The orphan watchdog: a worker no head connects to or calls for orphan_s exits."""
    from colibri.cluster.worker import ExpertWorker
    from colibri.io.container import Container

    c = Container(models["olmoe-1b-7b"])
    owned = {p: [0] for p in c.expert_layouts}
    worker = ExpertWorker.remote(str(c.dir), owned, None, None, True, 1, "f32", bytes(32), 2.0, "test")
    pid = ray_cluster.get(worker.ready.remote())["pid"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the orphaned worker is still running after 60 s")


def test_a_turns_profile_splits_the_hop(ray_cluster, models):
    """Generation.profile["cluster"]: the turn's MoE layers, ms per layer of wall, compute and
    transport (the wire's network-and-head and worker I/O shares within it), and faults."""
    engine = _cluster(models["qwen3-30b-a3b"], expert_workers=2)
    try:
        p = engine.generate(PROMPT[:8], max_tokens=4, stop_at_eos=False).profile["cluster"]
        moe_layers = len(engine.container.expert_layouts)
        assert p["layers"] == moe_layers * 4  # the prompt's chunk, then 3 decode steps
        assert p["worker_faults"] == 0 and p["local_ms_per_layer"] < 0.05  # no worker failed: nothing computed here
        assert 0 < p["compute_ms_per_layer"] <= p["wall_ms_per_layer"]
        assert p["transport_ms_per_layer"] == pytest.approx(p["wall_ms_per_layer"] - p["compute_ms_per_layer"], abs=1e-3)
        assert p["network_ms_per_layer"] > 0 and p["worker_io_ms_per_layer"] > 0
        assert _single(models["qwen3-30b-a3b"]).generate(PROMPT[:4], max_tokens=2).profile["cluster"] is None
    finally:
        engine.experts.close()
