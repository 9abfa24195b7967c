"""gpu/formats/gguf_reader.py's GGUFHeader against gguf-py's GGUFReader: the same fields and tensors."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from gpu.formats.gguf_reader import GGUFHeader
from gpu.tokenizers.files import default_model_path


def _same(path) -> GGUFHeader:
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]   # the header's own counts
    assert list(ours.fields) == keys
    for k in keys:
        want, got = theirs.fields[k].contents(), ours.fields[k].contents()
        assert type(got) is type(want) and got == want, k
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8))
    return ours


def test_the_bundled_model_reads_as_gguf_py_reads_it():
    h = _same(default_model_path())
    assert len(h.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert h.fields["general.architecture"].contents() == "llama"


def test_every_value_type_and_tensor_kind_gguf_py_writes(tmp_path):
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -3000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -2**40)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ünï", "x y"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = _same(path)
    assert h.fields["t.strs"].contents() == ["a", "", "ünï", "x y"]
    assert h.fields["t.bool"].contents() is True
    assert [t.data.shape for t in h.tensors] == [(3, 64), (2, 32), (4, 68)]


def test_a_truncated_or_foreign_file_is_a_clear_error(tmp_path):
    good = default_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFHeader(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(good[:5000])        # inside the vocabulary's strings
    with pytest.raises(ValueError, match="cut short or damaged"):
        GGUFHeader(head)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFHeader(other)


def test_the_type_tables_are_gguf_pys_and_reading_skips_its_import():
    """gpu/formats/gguf_reader.py keeps ggml's type ids and block sizes itself, so that a process
    start does not import the gguf package (and mistral-common with it)."""
    import subprocess
    import sys

    from gpu.formats import gguf_reader

    assert {t.name: int(t) for t in gguf_reader.GGUFValueType} == \
        {t.name: int(t) for t in gguf.GGUFValueType}
    assert {t.name: int(t) for t in gguf_reader.GGMLQuantizationType} == \
        {t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {int(k): v for k, v in gguf_reader.GGML_QUANT_SIZES.items()} == \
        {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    code = ("import sys; from gpu.tokenizers.files import load_tokenizer, default_model_path; "
            "from gpu.formats.gguf import GGUFFile; load_tokenizer(None); "
            "GGUFFile.open(default_model_path()); print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('gguf', 'mistral_common')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
