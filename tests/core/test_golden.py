"""Golden vectors: key format v1 and the digests of fixed inputs, pinned forever.

If one of these fails, a release would silently turn every cached entry into a miss:
do not update the vectors, fix the code (a new format is ``mmk2``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import blake3
import pytest

from mmkey import (
    EmbeddingKey,
    HashScheme,
    Modality,
    hash_bytes,
    hash_tensor,
    identifier_digest,
    mm_hash,
)

if TYPE_CHECKING:
    import torch


def fixed_tensors() -> dict[str, torch.Tensor]:
    import torch

    grid = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "f32_3x4": grid,
        "bf16_3x4": grid.bfloat16(),
        "f32_12": grid.reshape(12),
        "u8_empty": torch.zeros(0, dtype=torch.uint8),
        "f32_scalar": torch.tensor(1.5),
    }


GOLDEN_DIGESTS = {
    "f32_3x4": ("601b89200e4ffa2f71483acfb804c0dd", "7a07d158e3a3beee35aed35580583235", "29e1889124dc651e"),
    "bf16_3x4": ("7e7b5efa1ad888ee7fb053335008532e", "411b54415cd99b6203ea950dd3b4eed7", "b77f881fda0756b0"),
    "f32_12": ("fdd1cecebb0a2427b544ab1e03a6e30c", "ea82a87e6c1beb33c06ec56b6ad290dc", "29e1889124dc651e"),
    "u8_empty": ("1102079852eefbb4d2348918a1d18f04", "53d2189c23d5a648d6ff6aa2980d3cc1", "e3b0c44298fc1c14"),
    "f32_scalar": (
        "15a9a8741a4b01aa6ced907f7b9cad10",
        "9782d085d3429f63842b909bdae43187",
        "c0e336a5f371ef22",
    ),
}
GOLDEN_BYTES = ("cc33c9f8a183096fd1f923f9f0b5056d", "5259948b730212d23d697c61a81305ac", "c9ddcc21adbc0353")
SCHEMES = (HashScheme.BLAKE3, HashScheme.XXH3, HashScheme.SGLANG)


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(GOLDEN_DIGESTS))
def test_tensor_digests_never_change(name: str) -> None:
    t = fixed_tensors()[name]
    got = tuple(f"{hash_tensor(t, s):0{s.hex_width}x}" for s in SCHEMES)
    assert got == GOLDEN_DIGESTS[name]


def test_byte_digests_never_change() -> None:
    got = tuple(f"{hash_bytes(b'mmkey', s):0{s.hex_width}x}" for s in SCHEMES)
    assert got == GOLDEN_BYTES


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(GOLDEN_DIGESTS))
def test_sglang_vectors_agree_with_independent_sha256(name: str) -> None:
    import torch

    raw = fixed_tensors()[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert GOLDEN_DIGESTS[name][2] == hashlib.sha256(raw).hexdigest()[:16]


GOLDEN_IDENTIFIERS = {
    "0": "1a8bc4298a81cd17021f1b3a47192dc5",
    "18446744073709551616": "20aa0a7f29f60bea1fa386fed4d30825",
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08": "68dee96048c968e4ea6544a657440396",
    "\u00e4": "61710c87d2568c2485ab6b2f61476fb3",
}


@pytest.mark.parametrize("identifier", sorted(GOLDEN_IDENTIFIERS))
def test_identifier_digests_never_change(identifier: str) -> None:
    assert f"{identifier_digest(identifier):032x}" == GOLDEN_IDENTIFIERS[identifier]


@pytest.mark.parametrize("identifier", sorted(GOLDEN_IDENTIFIERS))
def test_identifier_vectors_agree_with_independent_blake3(identifier: str) -> None:
    expected = blake3.blake3(b"mmkey/id/v1\x00" + identifier.encode()).hexdigest(16)
    assert GOLDEN_IDENTIFIERS[identifier] == expected


GOLDEN_KEYS = [
    (
        ("qwen2-vl-7b", Modality.IMAGE, HashScheme.BLAKE3, 0x601B89200E4FFA2F71483ACFB804C0DD),
        "mmk1@qwen2-vl-7b@image@blake3@601b89200e4ffa2f71483acfb804c0dd",
    ),
    (
        ("qwen2-vl-7b", Modality.VIDEO, HashScheme.XXH3, 0),
        "mmk1@qwen2-vl-7b@video@xxh3@00000000000000000000000000000000",
    ),
    (
        ("whisper", Modality.AUDIO, HashScheme.SGLANG, 0x29E1889124DC651E),
        "mmk1@whisper@audio@sglang@29e1889124dc651e",
    ),
    (
        ("org/model@rev:1 ä", Modality.IMAGE, HashScheme.SGLANG, 2**64 - 1),
        "mmk1@org%2Fmodel%40rev%3A1%20%C3%A4@image@sglang@ffffffffffffffff",
    ),
    (
        ("A-Z.a_z~09", Modality.AUDIO, HashScheme.BLAKE3, 2**128 - 1),
        "mmk1@A-Z.a_z~09@audio@blake3@ffffffffffffffffffffffffffffffff",
    ),
    (("%", Modality.VIDEO, HashScheme.SGLANG, 1), "mmk1@%25@video@sglang@0000000000000001"),
    (
        ("\U0001f642", Modality.IMAGE, HashScheme.XXH3, 0xABC),
        "mmk1@%F0%9F%99%82@image@xxh3@00000000000000000000000000000abc",
    ),
    (
        ("qwen2-vl-7b", Modality.VIDEO, HashScheme.ID, 0x1A8BC4298A81CD17021F1B3A47192DC5),
        "mmk1@qwen2-vl-7b@video@id@1a8bc4298a81cd17021f1b3a47192dc5",
    ),
]


@pytest.mark.parametrize(("parts", "text"), GOLDEN_KEYS)
def test_key_text_never_changes(parts: tuple[str, Modality, HashScheme, int], text: str) -> None:
    namespace, modality, scheme, digest = parts
    key = EmbeddingKey(namespace, modality, scheme, mm_hash(digest))
    assert key.to_key() == text
    assert EmbeddingKey.from_key(text) == key


def test_golden_keys_cover_every_scheme_and_modality() -> None:
    covered = {(p[1], p[2]) for p, _ in GOLDEN_KEYS}
    assert {m for m, _ in covered} == set(Modality)
    assert {s for _, s in covered} == set(HashScheme)
