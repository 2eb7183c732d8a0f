"""Registered pools and page addressing of the SGLang integration (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch

from mmkey import Modality
from mmkey.integrations.sglang._pools import PoolTable, UnknownBuffer


def test_pools_take_modalities_in_sglang_registration_order() -> None:
    table = PoolTable()
    vision = torch.zeros(8, 4, dtype=torch.bfloat16)
    audio = torch.zeros(8, 2, dtype=torch.float32)
    assert table.modalities() == [Modality.IMAGE, Modality.AUDIO]  # none yet: either
    assert table.register(vision).modality is Modality.IMAGE
    assert table.modalities() == [Modality.IMAGE]
    assert table.register(audio).modality is Modality.AUDIO
    with pytest.raises(ValueError, match="third pool"):
        table.register(torch.zeros(2, 2))
    assert table.register(torch.zeros(2, 2), Modality.VIDEO).modality is Modality.VIDEO


def test_runs_map_to_rows_of_their_pool() -> None:
    table = PoolTable()
    pool = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    table.register(pool)
    row = 16  # bytes
    found, runs = table.locate([pool.data_ptr() + 6 * row, pool.data_ptr() + 1 * row], [2 * row, row])
    assert found.tensor is pool
    assert [r.tolist() for r in runs] == [pool[6:8].tolist(), pool[1:2].tolist()]
    runs[1].fill_(-1)  # views, not copies
    assert pool[1].tolist() == [-1.0] * 4


@pytest.mark.parametrize(
    ("offset", "size", "why"),
    [
        (-16, 16, "no registered pool"),
        (160, 16, "no registered pool"),
        (144, 32, "outside"),
        (8, 16, "whole rows"),
        (0, 24, "whole rows"),
        (0, 0, "whole rows"),
    ],
)
def test_memory_outside_whole_rows_is_refused(offset: int, size: int, why: str) -> None:
    table = PoolTable()
    pool = torch.zeros(10, 4, dtype=torch.float32)
    table.register(pool)
    with pytest.raises(UnknownBuffer, match=why):
        table.locate([pool.data_ptr() + offset], [size])


def test_runs_must_stay_in_one_pool_and_match_their_sizes() -> None:
    table = PoolTable()
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    table.register(a)
    table.register(b)
    with pytest.raises(UnknownBuffer, match="outside"):
        table.locate([a.data_ptr(), b.data_ptr()], [16, 16])
    with pytest.raises(UnknownBuffer, match="matching"):
        table.locate([a.data_ptr()], [16, 16])
    with pytest.raises(UnknownBuffer, match="matching"):
        table.locate([], [])


def test_pools_must_be_contiguous_2d_cpu_tensors_that_do_not_overlap() -> None:
    table = PoolTable()
    with pytest.raises(TypeError, match="2-D"):
        table.register(torch.zeros(4))
    with pytest.raises(TypeError, match="contiguous"):
        table.register(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        table.register(b"pool")  # type: ignore[arg-type]
    big = torch.zeros(8, 4)
    table.register(big)
    with pytest.raises(ValueError, match="overlaps"):
        table.register(big[2:4])


def test_a_run_of_one_byte_is_one_row_of_a_pool_of_one_byte_rows() -> None:
    """Only an empty run is refused for its size: any whole number of rows, one included, maps."""
    table = PoolTable()
    pool = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
    table.register(pool)
    found, [run] = table.locate([pool.data_ptr() + 3], [1])
    assert found.tensor is pool and run.tolist() == [[3]]
    with pytest.raises(UnknownBuffer, match="whole rows"):
        table.locate([pool.data_ptr() + 3], [0])


def test_pools_that_touch_without_overlapping_register_in_either_order() -> None:
    """Two halves of one allocation share a boundary address, not a byte."""
    for first, second in ((0, 1), (1, 0)):
        table = PoolTable()
        whole = torch.zeros(8, 4)
        halves = (whole[:4], whole[4:])
        table.register(halves[first])
        table.register(halves[second])
        assert len(table.pools()) == 2
