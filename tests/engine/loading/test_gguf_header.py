"""engine.loading.gguf_header against the `gguf` package's own reader: files written here
with its writer (every metadata value type, custom alignment, many tensor types), the embedded
model's file, and damaged headers, which must each be a ValueError."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFEndian,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
)

from engine.loading import source as loader
from engine.loading.gguf_header import GGUFHeader, read_header, tensor_values

Q = GGMLQuantizationType
V = GGUFValueType


def _write(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int = 64) -> None:
    """A file holding every value type GGUF has, arrays of each, and tensors of float and
    block types, aligned to `alignment`."""
    writer = GGUFWriter(path, "llama", endianess=endianess)
    writer.add_custom_alignment(alignment)
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4000000000,
               V.INT32: -2000000000, V.FLOAT32: 0.1, V.BOOL: True, V.UINT64: 2**63 + 5,
               V.INT64: -(2**62), V.FLOAT64: 1e-300}  # fmt: skip
    for kind, value in scalars.items():
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
        writer.add_key_value(f"test.{kind.name.lower()}s", [value, value], V.ARRAY, kind)
    writer.add_string("test.string", "é, 中文 and \n")
    writer.add_string("test.empty_string", "")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "", "▁the", "中"] * 50)
    writer.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    gen = np.random.default_rng(0)
    writer.add_tensor("a.weight", gen.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("b.weight", gen.standard_normal((5,), dtype=np.float32).astype(np.float16))
    for qtype in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS):
        block, block_bytes = GGML_QUANT_SIZES[qtype]  # random blocks: only the layout counts
        blocks = gen.integers(0, 256, (4, 512 // block * block_bytes), dtype=np.uint8)
        writer.add_tensor(f"{qtype.name}.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _the_readers_header(path: Path) -> tuple[dict[str, Any], dict[str, int], list[tuple]]:
    """What `GGUFReader` reads: metadata as `contents()`, array lengths, tensor entries."""
    reader = GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    lengths = {k: len(f.data) for k, f in fields.items() if f.types[0] == V.ARRAY}
    tensors = [
        (t.name, t.tensor_type.name, tuple(reversed(t.shape.tolist())), int(t.data_offset),
         int(t.n_bytes))
        for t in reader.tensors
    ]  # fmt: skip
    return {k: f.contents() for k, f in fields.items()}, lengths, tensors


def _entries(header: GGUFHeader) -> list[tuple]:
    return [(t.name, t.kind, t.shape, t.offset, t.num_bytes) for t in header.tensors]


def test_a_header_reads_as_the_gguf_packages_reader_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    metadata, lengths, tensors = _the_readers_header(path)
    header = read_header(path, string_arrays={"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
    assert header.metadata == metadata
    for key, value in metadata.items():
        assert type(header.metadata[key]) is type(value), key
    assert header.array_lengths == lengths
    assert _entries(header) == tensors
    assert header.tensors[0].offset % 64 == 0
    assert header.arch == "llama"


def test_arrays_of_strings_are_skipped_unless_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    everything = read_header(path, string_arrays={"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
    header = read_header(path, string_arrays={"tokenizer.ggml.merges"})
    assert "tokenizer.ggml.tokens" not in header.metadata
    assert header.metadata["tokenizer.ggml.merges"] == ["a b", "c d"]
    assert header.array_lengths["tokenizer.ggml.tokens"] == 200
    assert everything.metadata["tokenizer.ggml.tokens"][:4] == ["<s>", "", "▁the", "中"]
    # skipping lands where reading does: the keys after it and the tensors are the same
    assert header.metadata == {
        k: v for k, v in everything.metadata.items() if k != "tokenizer.ggml.tokens"
    }
    assert header.tensors == everything.tensors


def test_small_float_tensors_are_read_as_float32(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    reader = GGUFReader(path)
    header = read_header(path)
    for name in ("a.weight", "b.weight"):
        ours = tensor_values(path, next(t for t in header.tensors if t.name == name))
        theirs = next(t for t in reader.tensors if t.name == name).data
        np.testing.assert_array_equal(ours, np.asarray(theirs, np.float32).ravel())
        assert ours.dtype == np.float32
    with pytest.raises(ValueError, match="not F32 or F16"):
        tensor_values(path, header.tensors[-1])


@pytest.mark.e2e
def test_the_embedded_models_header_reads_as_the_gguf_packages_reader_reads_it() -> None:
    path = loader._default_gguf_path()
    metadata, lengths, tensors = _the_readers_header(path)
    strings = {k for k, v in metadata.items() if k in lengths and isinstance(v[0], str)}
    header = read_header(path, string_arrays=strings)
    assert header.metadata == metadata
    assert header.array_lengths == lengths
    assert _entries(header) == tensors


def test_a_big_endian_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    _write(path, endianess=GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian"):
        read_header(path)


@pytest.mark.parametrize(
    ("bytes_", "match"),
    [
        (b"", "too short"),
        (b"GGML" + bytes(40), "no GGUF magic"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62), "runs past the end"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 0), "no general.architecture"),
    ],
)
def test_what_is_not_a_gguf_header_is_a_value_error(
    tmp_path: Path, bytes_: bytes, match: str
) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(bytes_)
    with pytest.raises(ValueError, match=match):
        read_header(path)


def test_a_header_cut_anywhere_is_a_value_error(tmp_path: Path) -> None:
    """Every cut through the metadata and the tensor table, and one through the last
    tensor's data: a ValueError naming the file, never another exception."""
    path = tmp_path / "all.gguf"
    _write(path)
    whole = path.read_bytes()
    header_end = read_header(path).tensors[0].offset
    cut = tmp_path / "cut.gguf"
    for size in [*range(24, header_end, 7), len(whole) - 1]:
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=r"cut\.gguf"):
            read_header(cut)


def _refused(tmp_path: Path, edit: Any, match: str) -> None:
    """A file written as `_write` does, `edit(writer)` applied first: a ValueError."""
    path = tmp_path / "refused.gguf"
    writer = GGUFWriter(path, "llama")
    edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=match):
        read_header(path)


def test_what_llama_cpp_refuses_is_refused(tmp_path: Path) -> None:
    """Arrays of arrays (at the first nesting: no depth of recursion to run out of), a
    tensor whose rows are not whole blocks, a tensor name twice, an alignment that is not a
    uint32: llama.cpp's reader refuses each, and so does this one, with a ValueError."""
    _refused(tmp_path, lambda w: w.add_array("x", [[1, 2], [3]]), "array of arrays")
    _refused(tmp_path, lambda w: w.add_array("x", [[[[[1]]]]]), "array of arrays")

    path = tmp_path / "rows.gguf"  # one Q4_0 row of 32, its shape rewritten as 2 rows of 16
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("t", np.zeros((1, 18), np.uint8), raw_dtype=Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dims = struct.pack("<I2Q", 2, 32, 1)
    assert path.read_bytes().count(dims) == 1
    path.write_bytes(path.read_bytes().replace(dims, struct.pack("<I2Q", 2, 16, 2)))
    with pytest.raises(ValueError, match="rows not whole blocks of 32"):
        read_header(path)

    path = tmp_path / "twice.gguf"  # the writer refuses a name twice: renamed in the bytes
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("ta", np.zeros(4, np.float32))
    writer.add_tensor("tb", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes().replace(b"tb", b"ta", 1))
    with pytest.raises(ValueError, match="a tensor name appears twice"):
        read_header(path)
    _refused(
        tmp_path,
        lambda w: w.add_key_value("general.alignment", 64, V.UINT64),
        "general.alignment is not a uint32",
    )


def test_a_damaged_count_or_type_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    whole = path.read_bytes()
    key = b"tokenizer.ggml.tokens"
    at = whole.index(key) + len(key)  # then: value type, item type, length
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(whole[: at + 8] + struct.pack("<Q", 2**60) + whole[at + 16 :])
    with pytest.raises(ValueError, match="runs past the end"):
        read_header(damaged)
    damaged.write_bytes(whole[:at] + struct.pack("<I", 77) + whole[at + 4 :])
    with pytest.raises(ValueError, match="unknown metadata value type 77"):
        read_header(damaged)
    name = b"Q4_K.weight"
    at = whole.index(name) + len(name) + 4 + 8 * 2  # then: the ggml type
    damaged.write_bytes(whole[:at] + struct.pack("<I", 250) + whole[at + 4 :])
    with pytest.raises(ValueError, match="unknown ggml type 250"):
        read_header(damaged)
