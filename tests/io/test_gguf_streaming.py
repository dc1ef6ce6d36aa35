"""Experts streamed from a GGUF file itself (colibri/io/gguf_link.py): the GGUF twin of a tiny
synthetic MoE (tools/gguf_synthetic.py: the same weights as Q4_0) gives the container's tokens,
resident and streamed through the RAM cache with pread and O_DIRECT; a damaged expert in the
user's file fails its checksum, naming the file."""
import shutil

import numpy as np
import pytest
from tools import gguf_synthetic, synthetic_moe

from colibri import Engine
from colibri.errors import EngineFault
from colibri.io.container import Container
from colibri.io.gguf_link import link_gguf

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py

PROMPT = [100, 2000, 3000, 400, 5000, 60, 700]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    d = tmp_path_factory.mktemp("twin")
    container = synthetic_moe.write_container(d / "c", "tiny", progress=False)
    gguf = gguf_synthetic.write_gguf(d / "m.gguf", container)
    return container, gguf, link_gguf(gguf, d / "linked", progress=False)


def tokens(model, **kw):
    return Engine.load(model, **kw).generate(PROMPT, max_tokens=12, stop_at_eos=False).token_ids


def budget_gb(model, experts: int) -> float:
    c = Container(model)
    blob = max(l.blob_bytes for l in c.expert_layouts.values())
    return (c.dense_bytes + experts * len(c.expert_layouts) * blob) / (1 << 30)


def test_the_index_points_into_the_gguf(twin):
    container, gguf, linked = twin
    c = Container(linked)
    assert c.gguf is not None and not any(p.suffix == ".safetensors" for p in linked.iterdir())
    prefix = next(iter(c.expert_layouts))
    ranges = c.expert_ranges(prefix, 3)
    assert [r.path for r in ranges] == [gguf] * 3  # gate, up, down: three stacked tensors
    assert c.expert_layouts[prefix].num_experts == Container(container).expert_layouts[prefix].num_experts


@pytest.mark.parametrize("mode", ["resident", "pread", "direct"])
def test_streamed_from_the_gguf_gives_the_containers_tokens(twin, mode):
    container, _, linked = twin
    want = tokens(container)
    if mode == "resident":
        assert tokens(linked, stream_experts=False) == want
        return
    e = Engine.load(linked, stream_experts=True, ram_gb=budget_gb(linked, 2), expert_io=mode)
    assert e.generate(PROMPT, max_tokens=12, stop_at_eos=False).token_ids == want
    assert e.experts.stats.reads > 0  # it did read from the file, through the cache


def test_a_damaged_expert_in_the_gguf_fails_its_checksum(twin, tmp_path):
    _, gguf, _ = twin
    copy = tmp_path / "m.gguf"
    shutil.copy(gguf, copy)
    linked = link_gguf(copy, tmp_path / "linked", progress=False)
    c = Container(linked)
    prefix = next(iter(c.expert_layouts))
    r = c.expert_ranges(prefix, 5)[1]  # expert 5's up rows
    with open(copy, "r+b") as f:
        f.seek(r.offset + r.nbytes // 2)
        b = f.read(1)
        f.seek(r.offset + r.nbytes // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    e = Engine.load(linked, stream_experts=True, ram_gb=budget_gb(linked, 1))
    buf = np.zeros(c.expert_layouts[prefix].blob_bytes, np.uint8)
    with pytest.raises(EngineFault, match=rf"expert 5 of {prefix} in m\.gguf failed its checksum"):
        e.experts._reader.read(prefix, 5, buf, verify=True)
    e.experts._reader.read(prefix, 4, buf, verify=True)  # the others still serve
