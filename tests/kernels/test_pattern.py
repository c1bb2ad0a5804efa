"""The simulated forward pass: fill_pattern / check_pattern / expected_block_bytes."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import DTYPES, ids, layout
from zkv.kernels import TorchCpuBackend
from zkv.kernels.reference import check_pattern, expected_block_bytes, fill_pattern

KEYS = [bytes([i]) * 16 for i in range(1, 6)]
DEV = [7, 0, 3, 11, 5]


def filled(dtype: str = "float16", **kw: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = TorchCpuBackend().allocate_device_cache(layout(dtype, **kw))
    fill_pattern(kv, ids(DEV), KEYS, rank=1)
    return kv


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_then_check_matches_every_block(dtype: str) -> None:
    kv = filled(dtype)
    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == len(KEYS)
    assert check_pattern(kv, ids(DEV[:2]), KEYS[:2], rank=1) == 2
    assert check_pattern(kv, ids([]), [], rank=1) == 0


def test_pattern_depends_on_rank_and_key() -> None:
    kv = filled()
    assert check_pattern(kv, ids(DEV), KEYS, rank=0) == 0
    assert check_pattern(kv, ids(DEV), [KEYS[0], KEYS[2], *KEYS[2:]], rank=1) == 1


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("kv_index", [0, 1])
@pytest.mark.parametrize("position", ["first", "last"])
def test_single_flipped_byte_is_found(layer: int, kv_index: int, position: str) -> None:
    kv = filled("bfloat16")
    block = kv[layer][kv_index][DEV[3]].view(torch.uint8).view(-1)
    at = 0 if position == "first" else block.numel() - 1
    block[at] ^= 0x01

    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == 3


def test_swapped_layers_and_swapped_k_v_are_found() -> None:
    kv = filled()
    (k1, _), (k2, v2) = kv[1], kv[2]
    k1[DEV[2]], k2[DEV[2]] = k2[DEV[2]].clone(), k1[DEV[2]].clone()
    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == 2

    kv = filled()
    k2, v2 = kv[2]
    k2[DEV[0]], v2[DEV[0]] = v2[DEV[0]].clone(), k2[DEV[0]].clone()
    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == 0


def test_zeroed_block_does_not_match() -> None:
    kv = filled()
    kv[0][1][DEV[4]].zero_()
    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == 4


def test_chunk_not_a_multiple_of_the_pattern_period() -> None:
    kv = filled("uint8", kv_heads=1, block_size=3, head_dim=5)  # 15-byte chunks
    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == len(KEYS)
    kv[1][0][DEV[1]].view(-1)[14] ^= 0x80
    assert check_pattern(kv, ids(DEV), KEYS, rank=1) == 1


def test_expected_block_bytes_equals_a_copied_host_block() -> None:
    lay = layout("bfloat16")
    backend = TorchCpuBackend()
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    fill_pattern(kv, ids(DEV), KEYS, rank=3)
    backend.copy_d2h(kv, host, ids(DEV), ids([8, 1, 0, 4, 2]))

    want = expected_block_bytes(lay, KEYS[3], rank=3)
    assert len(want) == lay.block_bytes
    assert bytes(backend.host_block(host, 4)) == want
    assert bytes(backend.host_block(host, 8)) != want


def test_loading_expected_bytes_into_host_then_device_checks() -> None:
    """The L3 path in miniature: s2h writes expected bytes, h2d moves them, check passes."""
    lay = layout()
    backend = TorchCpuBackend()
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    for h, key in zip([5, 6], KEYS[:2]):
        backend.host_block(host, h)[:] = expected_block_bytes(lay, key, rank=0)
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, ids([5, 6]), ids([9, 2]), layer)

    assert check_pattern(kv, ids([9, 2]), KEYS[:2], rank=0) == 2


def test_mismatched_keys_and_bad_ids_rejected() -> None:
    kv = filled()
    with pytest.raises(ValueError, match="2 device ids but 1 keys"):
        check_pattern(kv, ids([0, 1]), KEYS[:1], rank=1)
    with pytest.raises(ValueError, match="out of range"):
        fill_pattern(kv, ids([12]), KEYS[:1], rank=1)
