"""A GGUF run in place (colibri/io/gguf_link.py): the linked directory holds only the index, its
model gives the tokens the converted container gives, and a file that changed or is damaged is
a one-line error at open, with nothing half-written left behind."""
import json
import shutil

import numpy as np
import pytest

from colibri import Engine
from colibri.errors import ColibriError
from colibri.formats.qtensor import dequantize
from colibri.io.container import MANIFEST, Container
from colibri.io.gguf_link import is_linked, link_gguf

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 2787, 30]


@pytest.fixture(scope="module")
def linked(smollm2_gguf, tmp_path_factory):
    return link_gguf(smollm2_gguf, tmp_path_factory.mktemp("link") / "smollm2", progress=False)


def test_the_index_holds_no_weights(linked, smollm2_gguf):
    import os

    files = {p.name: p.stat().st_size for p in linked.iterdir()}
    assert set(files) == {MANIFEST, "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert sum(files.values()) < os.path.getsize(smollm2_gguf) / 20  # the tokenizer is most of it
    assert is_linked(linked)
    manifest = json.loads((linked / MANIFEST).read_text())
    assert manifest["kind"] == "gguf-link" and manifest["gguf_files"][0]["path"] == str(smollm2_gguf)


def test_linked_tensors_equal_the_converted_container(linked, smollm2_container):
    a, b = Container(linked), Container(smollm2_container)
    assert a.config == b.config and sorted(a.manifest["tensors"]) == sorted(b.manifest["tensors"])
    assert a.dense_bytes == b.dense_bytes
    for name in list(a.manifest["tensors"])[:40]:
        x, y = a.tensor(name), b.tensor(name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), name
        else:
            assert x.scheme == y.scheme and np.array_equal(dequantize(x), dequantize(y)), name


def test_linked_model_gives_the_containers_tokens(linked, smollm2_container):
    want = Engine.load(smollm2_container).generate(PROMPT, max_tokens=16, stop_at_eos=False).token_ids
    got = Engine.load(linked).generate(PROMPT, max_tokens=16, stop_at_eos=False).token_ids
    assert got == want


def test_a_changed_file_is_refused_at_open(smollm2_gguf, tmp_path):
    gguf = tmp_path / "m.gguf"
    shutil.copy(smollm2_gguf, gguf)
    d = link_gguf(gguf, tmp_path / "link", progress=False)
    with open(gguf, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(ColibriError, match=r"m\.gguf has changed since it was indexed"):
        Container(d)
    gguf.unlink()
    with pytest.raises(ColibriError, match=r"m\.gguf \(indexed in .*\) is missing"):
        Container(d)


def test_a_truncated_file_leaves_no_index(smollm2_gguf, tmp_path):
    gguf = tmp_path / "cut.gguf"
    data = open(smollm2_gguf, "rb").read()
    gguf.write_bytes(data[: len(data) // 2])
    with pytest.raises(ColibriError, match="cut.gguf"):
        link_gguf(gguf, tmp_path / "link", progress=False)
    assert not (tmp_path / "link").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["cut.gguf"]  # no temporary directory left either
