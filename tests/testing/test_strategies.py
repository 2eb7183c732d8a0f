"""The public hypothesis strategies give valid values and reach the hostile cases."""

from __future__ import annotations

import subprocess
import sys

import torch
from hypothesis import find, given
from hypothesis import strategies as st

from mmkey import EmbeddingKey, HashScheme, MMHash, Modality, mm_hash
from mmkey.testing.strategies import (
    HOSTILE_NAMESPACES,
    digests,
    embedding_keys,
    feature_tensors,
    key_texts,
    namespaces,
)


@given(st.sampled_from(HashScheme), st.data())
def test_digests_fit_their_scheme(scheme: HashScheme, data: st.DataObject) -> None:
    d = data.draw(digests(scheme))
    assert mm_hash(d, scheme) == d


def test_digests_reach_both_edges() -> None:
    assert find(digests(HashScheme.SGLANG), lambda d: d == 2**64 - 1) == 2**64 - 1
    assert find(digests(), lambda d: d == 0) == 0


@given(st.from_type(MMHash))
def test_from_type_mmhash_is_registered_and_valid(d: MMHash) -> None:
    assert type(d) is int and mm_hash(d) == d


@given(st.from_type(EmbeddingKey))
def test_from_type_embedding_key_is_registered(key: EmbeddingKey) -> None:
    assert EmbeddingKey.from_key(key.to_key()) == key


@given(namespaces())
def test_namespaces_are_valid(ns: str) -> None:
    EmbeddingKey(ns, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(0))


def test_namespaces_reach_hostile_text() -> None:
    for needle in ("@", "%", "/", " "):
        assert needle in find(namespaces(), lambda s, n=needle: n in s)  # type: ignore[misc]
    assert not find(namespaces(), lambda s: not s.isascii()).isascii()
    assert all(EmbeddingKey(ns, Modality.IMAGE, HashScheme.BLAKE3, mm_hash(0)) for ns in HOSTILE_NAMESPACES)


@given(key_texts())
def test_key_texts_parse(text: str) -> None:
    assert EmbeddingKey.from_key(text).to_key() == text


@given(embedding_keys(scheme=st.just(HashScheme.SGLANG), modality=st.just(Modality.AUDIO)))
def test_embedding_keys_respect_fixed_parts(key: EmbeddingKey) -> None:
    assert key.scheme is HashScheme.SGLANG and key.modality is Modality.AUDIO


@given(feature_tensors())
def test_feature_tensors_are_cpu_tensors(t: torch.Tensor) -> None:
    assert t.device.type == "cpu" and t.dim() <= 3


def test_feature_tensors_reach_bf16_empty_scalar_and_strided() -> None:
    assert find(feature_tensors(), lambda t: t.dtype == torch.bfloat16).dtype == torch.bfloat16
    assert find(feature_tensors(), lambda t: t.numel() == 0).numel() == 0
    assert find(feature_tensors(), lambda t: t.dim() == 0).dim() == 0
    assert not find(feature_tensors(), lambda t: not t.is_contiguous()).is_contiguous()


def test_the_strategies_module_imports_first_and_registers_its_types() -> None:
    # importing it before hypothesis runs mmkey's hypothesis entry point mid-import
    code = (
        "import mmkey.testing.strategies\n"
        "from hypothesis import strategies as st\n"
        "from mmkey import EmbeddingKey\n"
        "assert isinstance(st.from_type(EmbeddingKey).example(), EmbeddingKey)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
