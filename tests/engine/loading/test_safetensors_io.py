"""Our safetensors reader and writer: the package's format both ways, damage reported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.memory import HUGE_PAGE
from engine.loading import safetensors_io


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=gen).bfloat16(),
        "f32.transposed": torch.randn(4, 6, generator=gen).t(),  # not contiguous
        "u8": torch.randint(0, 255, (7,), generator=gen, dtype=torch.uint8),
        "i64.scalar": torch.tensor(42),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_what_we_write_the_safetensors_package_reads(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors_io.write(tensors, tmp_path / "a.safetensors")
    _assert_same(
        dict(sorted(load_file(tmp_path / "a.safetensors").items())), dict(sorted(tensors.items()))
    )
    _assert_same(safetensors_io.read(tmp_path / "a.safetensors"), tensors)


def test_we_read_what_the_safetensors_package_writes(tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in _tensors().items()}
    save_file(tensors, tmp_path / "b.safetensors", metadata={"format": "pt"})
    got = safetensors_io.read(tmp_path / "b.safetensors")
    _assert_same(dict(sorted(got.items())), dict(sorted(tensors.items())))
    got["bf16"].add_(1)  # each tensor owns its memory: writable, not a view of a mapping


def test_a_file_read_onto_huge_pages_is_the_same_tensors_in_one_mapping(tmp_path: Path) -> None:
    """`huge_pages`: every tensor read into one HugePageArena (the quantized cache's weights
    land on 2 MB pages with no copy), the first at a 2 MB boundary."""
    tensors = _tensors()
    safetensors_io.write(tensors, tmp_path / "h.safetensors")
    got = safetensors_io.read(tmp_path / "h.safetensors", huge_pages=True)
    _assert_same(got, tensors)
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1
    assert got["bf16"].data_ptr() % HUGE_PAGE == 0
    got["bf16"].add_(1)  # writable


def test_a_truncated_file_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    safetensors_io.write(_tensors(), path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        safetensors_io.read(path)


def test_a_file_that_is_not_safetensors_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    path.write_bytes((12).to_bytes(8, "little") + b"not json at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_io.read(path)


def test_an_unsupported_dtype_is_named(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    save_file({"x": torch.zeros(2, dtype=torch.complex64)}, path)
    with pytest.raises(ValueError, match="unsupported dtype C64"):
        safetensors_io.read(path)


def test_a_stream_is_written_one_tensor_at_a_time(tmp_path: Path) -> None:
    tensors = _tensors()
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    made: list[str] = []

    def one_at_a_time() -> Iterator[torch.Tensor]:
        for name, tensor in tensors.items():
            made.append(name)
            yield tensor

    safetensors_io.write_stream(specs, one_at_a_time(), tmp_path / "s.safetensors")
    assert made == list(tensors)
    _assert_same(safetensors_io.read(tmp_path / "s.safetensors"), tensors)
    _assert_same(
        dict(sorted(load_file(tmp_path / "s.safetensors").items())), dict(sorted(tensors.items()))
    )


@pytest.mark.parametrize(
    "stream",
    [
        [torch.zeros(2, 3)],  # one short
        [torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)],  # one over
        [torch.zeros(3, 2), torch.zeros(4)],  # a shape that is not its spec's
        [torch.zeros(2, 3, dtype=torch.float16), torch.zeros(4)],  # nor a dtype
    ],
)
def test_a_stream_that_does_not_match_its_specs_is_refused(
    tmp_path: Path, stream: list[torch.Tensor]
) -> None:
    specs = {"a": (torch.float32, (2, 3)), "b": (torch.float32, (4,))}
    with pytest.raises(ValueError):
        safetensors_io.write_stream(specs, iter(stream), tmp_path / "bad.safetensors")
