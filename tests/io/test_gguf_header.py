"""The GGUF metadata and tensor table read with struct (colibri/io/gguf/reader.py _read_header),
which a first start uses instead of gguf's GGUFReader (3 s of numpy views for SmolLM2's
vocabulary): the same values, keys in the same order, the same tensor table; anything it would
not read the same way is left to GGUFReader."""
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from colibri.io.gguf import reader as R  # noqa: E402


def both(path: Path):
    header = R._read_header(path)
    return header, gguf.GGUFReader(path)


def assert_same(path: Path) -> None:
    header, reference = both(path)
    assert header is not None
    assert list(R._metadata(header).items()) == list(R._metadata(reference).items())
    assert R._tensor_refs(path, header) == R._tensor_refs(path, reference)


def test_the_default_model_reads_the_same(smollm2_gguf):
    assert_same(Path(smollm2_gguf))


def write(path: Path, extra=None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -2)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ü" * 3])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False])
    if extra:
        extra(w)
    w.add_tensor("a", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b", np.ones((3, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_the_same(tmp_path):
    assert_same(write(tmp_path / "all.gguf"))


def test_a_damaged_file_is_left_to_gguf(tmp_path):
    """A truncated file: _read_header declines, so the error colibri reports is GGUFReader's, as
    before (tests/io/test_gguf_import.py checks its wording)."""
    whole = write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in (len(whole) - 40, 100, 30):
        cut.write_bytes(whole[:end])
        assert R._read_header(cut) is None
