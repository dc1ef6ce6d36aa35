"""Expert streaming: placement (budget, prefetch, hot set, io mode) never changes tokens; the
upcycled SmolLM2-MoE speaks as the dense model does; faults give clear errors; history persists."""
import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from tools import synthetic_moe
from tools import upcycle

from colibri import ColibriError, Engine
from colibri.errors import EngineFault
from colibri.io.container import Container

GiB = 1 << 30


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A tiny random OLMoE-shaped model: every expert distinct, so a misplaced expert shows."""
    return synthetic_moe.write_container(tmp_path_factory.mktemp("syn") / "m", "tiny", progress=False)


@pytest.fixture(scope="module")
def upcycled(smollm2_container, tmp_path_factory):
    return upcycle.upcycle(smollm2_container, tmp_path_factory.mktemp("up") / "m", experts=8, top_k=2)


def budget_gb(model: Path, experts_per_layer: float) -> float:
    c = Container(model)
    per_layer = sum(l.blob_bytes for l in c.expert_layouts.values())
    return (c.dense_bytes + experts_per_layer * per_layer) / GiB


def run(engine: Engine, seq: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after a fixed prompt (decode path) and logits over a forced sequence
    (prefill path, every position)."""
    engine.reset()
    toks = engine.generate(seq[:5], max_tokens=12, stop_at_eos=False).token_ids
    return toks, engine.logits(seq)


SEQ = np.random.default_rng(3).integers(0, 49152, size=40).tolist()


@pytest.mark.parametrize("experts_per_layer", [0, 3, 8])
@pytest.mark.parametrize("io", ["pread", "direct", "mmap"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_placement_never_changes_tokens(synthetic, experts_per_layer, io, prefetch):
    ref_tokens, ref_logits = run(Engine.load(synthetic, stream_experts=False), SEQ)
    e = Engine.load(synthetic, ram_gb=budget_gb(synthetic, experts_per_layer + 0.5), stream_experts=True,
                    expert_io=io, prefetch=prefetch)
    if io != "mmap":
        assert e.experts.slots_per_layer == experts_per_layer
    tokens, logits = run(e, SEQ)
    assert tokens == ref_tokens
    assert np.array_equal(logits, ref_logits)  # the same bytes through the same kernels: bit-identical
    stats = e.expert_stats
    if io != "mmap" and experts_per_layer == 0:
        assert stats["hits"] == 0 and stats["bytes_read"] > 0


def test_row_layout_changes_no_bits(synthetic):
    """Experts (and dense matrices) interleaved once read, or left row-major: the same bits,
    resident and streamed (a streamed store under "rows" keeps its slots row-major)."""
    ref_tokens, ref_logits = run(Engine.load(synthetic, stream_experts=False), SEQ)
    assert Engine.load(synthetic, stream_experts=False).experts.fused(
        next(iter(Container(synthetic).expert_layouts))).layout[:, 4].max() > 1  # interleaved kernel
    for options in ({"stream_experts": False}, {"ram_gb": budget_gb(synthetic, 3.5), "stream_experts": True}):
        tokens, logits = run(Engine.load(synthetic, weight_layout="rows", **options), SEQ)
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits)


def test_upcycled_moe_speaks_as_the_dense_model(smollm2_container, upcycled):
    dense = Engine.load(smollm2_container)
    moe = Engine.load(upcycled, ram_gb=budget_gb(upcycled, 3), stream_experts=True)
    for prompt in ("What is the capital of France?", "Write a haiku about the sea.", "Name three fruits."):
        a, b = dense.generate(prompt, max_tokens=24), moe.generate(prompt, max_tokens=24)
        assert a.text == b.text
        assert b.experts["bytes_read"] > 0 and 0 <= b.experts["hit_rate"] <= 1


def test_hot_set_is_learned_from_history(synthetic):
    e = Engine.load(synthetic, ram_gb=budget_gb(synthetic, 4), stream_experts=True, prefetch=False)
    e.generate(SEQ[:20], max_tokens=10, stop_at_eos=False)
    counts = e.experts.routing_counts()
    again = Engine.load(synthetic, ram_gb=budget_gb(synthetic, 4), stream_experts=True, prefetch=False)
    # Half of the slots (4 per layer on average) hold the most-routed experts of all layers.
    n_hot = 2 * len(counts)
    heat = sorted((-c, li, e) for li, p in enumerate(counts) for e, c in enumerate(counts[p]) if c > 0)
    want = {(li, e) for _, li, e in heat[:n_hot]}
    pinned = {(li, e) for li, t in enumerate(again.experts.tiers().values()) for e in t["pinned"]}
    assert pinned == want and len(pinned) == min(n_hot, len(heat))
    assert again.generate(SEQ[:20], max_tokens=10, stop_at_eos=False).token_ids == \
        e.generate(SEQ[:20], max_tokens=10, stop_at_eos=False).token_ids


def test_corrupt_history_is_ignored_with_a_warning(synthetic, tmp_path):
    from colibri.default_model import history_path

    path = history_path(Container(synthetic).dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{ not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = Engine.load(synthetic, ram_gb=budget_gb(synthetic, 2), stream_experts=True)
    assert any("routing history" in str(w.message) for w in caught)
    assert e.generate(SEQ[:5], max_tokens=3, stop_at_eos=False).completion_tokens == 3
    assert json.loads(path.read_text())["version"] == 1  # rewritten at the turn end


def test_processes_sharing_a_model_save_its_history_without_racing(tmp_path):
    """Two servers on one model both save its routing history at every turn end; with one
    temporary file name for every process, one's rename found the file gone (ENOENT) and warned
    "could not save routing history" (the soak's two servers, bench/serve/soak.py)."""
    path = tmp_path / "history.json"
    code = ("import sys, warnings; import numpy as np; from pathlib import Path; warnings.simplefilter('error'); "
            "from colibri.io.expert_store import save_history; "
            "[save_history(Path(sys.argv[1]), {}, {'layer': np.arange(256)}) for _ in range(400)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert json.loads(path.read_text())["counts"]["layer"] == list(range(256))
    assert not list(tmp_path.glob("*.tmp"))


def test_truncated_expert_file_fails_the_request_not_the_engine(synthetic, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(synthetic, model)
    ref = Engine.load(synthetic, stream_experts=False).generate(SEQ[:5], max_tokens=6, stop_at_eos=False)
    layer0 = model / Container(model).expert_layouts["model.layers.0.mlp"].file
    original = layer0.read_bytes()
    e = Engine.load(model, ram_gb=budget_gb(model, 0.5), stream_experts=True)
    with open(layer0, "r+b") as f:  # the file loses its upper experts while the engine runs
        f.truncate(len(original) // 2)
    with pytest.raises(EngineFault, match="truncated"):  # a server fault (5xx), not the client's
        for seed in range(8):  # some prompt routes to a lost expert
            e.generate(np.random.default_rng(seed).integers(0, 49152, 30).tolist(), max_tokens=4)
    layer0.write_bytes(original)  # the engine itself is still fine once the data is back
    assert e.generate(SEQ[:5], max_tokens=6, stop_at_eos=False).token_ids == ref.token_ids


def test_truncated_expert_file_is_refused_at_load(synthetic, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(synthetic, model)
    layer0 = model / Container(model).expert_layouts["model.layers.0.mlp"].file
    with open(layer0, "r+b") as f:
        f.truncate(layer0.stat().st_size - 4096)
    with pytest.raises(ColibriError, match="truncated"):
        Engine.load(model, stream_experts=True)


def test_dense_part_must_fit_the_budget(synthetic):
    with pytest.raises(ColibriError, match="dense weights need"):
        Engine.load(synthetic, ram_gb=0.001)


def test_one_lru_over_all_layers_lets_a_busy_layer_use_idle_slots(synthetic):
    """The budget is one pool: a layer that routes to many experts may hold more than its
    average share of slots while quiet layers hold fewer; nothing is pinned without history."""
    from colibri.io.expert_store import ExpertStore, StoreConfig

    c = Container(synthetic)
    prefixes = list(c.expert_layouts)  # tiny: 3 MoE layers of 8 experts
    store = ExpertStore(c, StoreConfig(ram_bytes=2 * sum(l.blob_bytes for l in c.expert_layouts.values()),
                                       io="pread", prefetch=False))
    try:
        assert store.slots_per_layer == 2 and len(store.slots.buffers) == 6
        busy = [0, 1, 2, 3, 4, 5]  # layer 0 alone asks for all six slots
        first = {e: ew["down_proj"].q.copy() for e, ew in store.iter_experts(prefixes[0], busy)}
        read = store.stats.bytes_read
        assert read == 6 * c.expert_range(prefixes[0], 0)[2]
        again = {e: ew["down_proj"].q.copy() for e, ew in store.iter_experts(prefixes[0], busy)}
        assert store.stats.bytes_read == read  # all six stayed in RAM: no per-layer cap
        assert all(np.array_equal(first[e], again[e]) for e in busy)
        assert store.tiers()[prefixes[0]]["lru"] == busy
        # Another layer's expert evicts the least recently used slot, whichever layer holds it.
        list(store.iter_experts(prefixes[1], [7]))
        assert store.tiers()[prefixes[0]]["lru"] == busy[1:]
        assert store.tiers()[prefixes[1]]["lru"] == [7]
    finally:
        store.close()


def test_load_shows_each_long_read_phase(synthetic, monkeypatch, capsys):
    """Engine.load(progress=True) names every read phase large enough to take a second (here the
    threshold is lowered to 0 so the tiny model's phases count): resident experts, the dense
    weights then the experts the readers have not finished (when the load waits for them), or
    the dense weights and a line saying the experts load on in the background; the dense
    weights alone when experts stream; with a budget, the hot set being pinned. Not a terminal:
    one line each."""
    import colibri.io.experts as ex
    from colibri.io import expert_store

    monkeypatch.setattr(expert_store, "SHOW_BYTES", 0)
    c = Container(synthetic)
    Engine.load(synthetic, stream_experts=False, progress=True)
    err = capsys.readouterr().err
    assert f"reading the dense weights of m ({c.dense_bytes / 1e9:.1f} GB)... done: " in err and "GB/s)" in err
    assert "reading the experts of m (" in err
    read = ex.read_expert

    def slow(*a, **kw):  # the readers are still at it when the dense weights are in
        time.sleep(0.2)
        return read(*a, **kw)

    monkeypatch.setattr(ex, "read_expert", slow)
    e = Engine.load(synthetic, stream_experts=False, progress=True, experts_in_background=True)
    err = capsys.readouterr().err
    assert f"reading the dense weights of m ({c.dense_bytes / 1e9:.1f} GB)... done: " in err
    assert f"the experts of m ({c.expert_bytes / 1e9:.1f} GB) go on loading in the background" in err
    e.experts.cancel()
    monkeypatch.setattr(ex, "read_expert", read)
    warm = Engine.load(synthetic, ram_gb=budget_gb(synthetic, 4), stream_experts=True)
    warm.generate(SEQ[:5], max_tokens=4, stop_at_eos=False)  # routing history: a hot set to pin
    capsys.readouterr()
    Engine.load(synthetic, ram_gb=budget_gb(synthetic, 4), stream_experts=True, progress=True)
    err = capsys.readouterr().err
    assert "pinning the hot set" in err and "reading the dense weights of m" in err
