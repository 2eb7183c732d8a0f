"""mmkey.encoder: per-item digests and keys, and encode_with_cache (sync).

A counting encoder shows that only misses reach it and each distinct item once; a
dict-backed cache that can be told to fail shows that cache failures recompute.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmkey import (
    CacheKey,
    CacheStats,
    EmbeddingKey,
    HashScheme,
    InvalidKey,
    Modality,
    StoreClosed,
    hash_tensor,
)
from mmkey.cache.memory import MemoryCache
from mmkey.encoder import (
    EncodeReport,
    Grid,
    embedding_keys,
    encode_with_cache,
    encode_with_cache_report,
    hashes_from_features,
    keys_from_features,
)

WIDTH = 6
NS = "model-a@rev1"


def item(image_id: int) -> tuple[torch.Tensor, Grid]:
    """The rows and grid of a synthetic image: the same id gives the same bytes."""
    grid = (1, 2 + image_id % 3, 2 + image_id % 2)
    gen = torch.Generator().manual_seed(image_id)
    return torch.randn(grid[0] * grid[1] * grid[2], WIDTH, generator=gen), grid


def request(ids: Sequence[int]) -> tuple[torch.Tensor, list[Grid]]:
    """A packed request of the given image ids, like Qwen2-VL's pixel_values/grid_thw."""
    parts = [item(i) for i in ids]
    rows = [r for r, _ in parts] or [torch.zeros(0, WIDTH)]
    return torch.cat(rows), [grid for _, grid in parts]


def reference(rows: torch.Tensor, grid: Grid, scale: float = 1.0) -> torch.Tensor:
    """What the fake model returns for one item: depends on its rows, grid and weights."""
    t, h, w = grid
    return (rows.sum(0, keepdim=True) + torch.tensor([[t, h, w, 0, 0, 0.0]])) * scale


class CountingEncoder:
    """A fake vision tower that records what it was asked to encode."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def items_encoded(self) -> int:
        return sum(int(g.shape[0]) for _, g in self.calls)

    def __call__(self, features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        self.calls.append((features, grid_thw))
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        sizes = [t * h * w for t, h, w in grids]
        assert sum(sizes) == features.shape[0], "the encoder gets exactly the missed rows"
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        rows = [features[s : s + n] for s, n in zip(starts, sizes, strict=True)]
        return [reference(r, g, self.scale) for r, g in zip(rows, grids, strict=True)]


class DictCache:
    """A minimal EmbeddingCache over a dict, with faults to order."""

    def __init__(self) -> None:
        self.entries: dict[str, torch.Tensor] = {}
        self.fail: set[str] = set()
        self.malformed: set[str] = set()
        self.forget_on_get: set[str] = set()
        self.calls: list[tuple[str, list[str]]] = []

    def _enter(self, op: str, keys: Sequence[CacheKey]) -> list[str]:
        texts = [k.to_key() for k in keys]
        self.calls.append((op, texts))
        if op in self.fail:
            raise ConnectionError(f"{op}: store unreachable")
        return texts

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        texts = self._enter("batch_is_exist", keys)
        if "batch_is_exist" in self.malformed:
            return [True]  # wrong length
        return [t in self.entries for t in texts]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        texts = self._enter("get_embeddings", keys)
        if "get_embeddings" in self.malformed:
            return ["not a tensor"] * len(texts)  # type: ignore[list-item]
        out: list[torch.Tensor | None] = []
        for t in texts:
            if t in self.forget_on_get:
                self.entries.pop(t, None)
            found = self.entries.get(t)
            out.append(None if found is None else found.clone())
        return out

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        texts = self._enter("insert_batch", keys)
        if "insert_batch" in self.malformed:
            return [1] * len(texts)  # type: ignore[list-item]
        for t, e in zip(texts, embeddings, strict=True):
            self.entries[t] = e.clone()
        return [True] * len(texts)

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self.entries))

    def close(self) -> None:
        pass


def ops(cache: DictCache) -> list[str]:
    return [op for op, _ in cache.calls]


# hashes_from_features and keys


def test_one_digest_per_item_and_equal_items_hash_equal() -> None:
    feature, grids = request([1, 2, 1, 3])
    digests = hashes_from_features(feature, grids)
    assert len(digests) == 4
    assert digests[0] == digests[2]
    assert len({digests[0], digests[1], digests[3]}) == 3
    alone = hashes_from_features(*request([2]))
    assert alone == [digests[1]], "an item's digest does not depend on its neighbours"


CONTENT_SCHEMES = [s for s in HashScheme if s.hashes_content]


@pytest.mark.parametrize("scheme", CONTENT_SCHEMES)
def test_grid_as_tensor_or_triples_gives_the_same_digests(scheme: HashScheme) -> None:
    feature, grids = request([4, 5, 6])
    expected = hashes_from_features(feature, grids, scheme=scheme)
    for dtype in (torch.int64, torch.int32):
        as_tensor = torch.tensor(grids, dtype=dtype)
        assert hashes_from_features(feature, as_tensor, scheme=scheme) == expected
    as_lists: Any = [list(g) for g in grids]  # e.g. grid_thw.tolist(): runtime accepts them
    assert hashes_from_features(feature, as_lists, scheme=scheme) == expected


@pytest.mark.parametrize("scheme", [HashScheme.BLAKE3, HashScheme.XXH3])
def test_framed_digests_cover_the_items_grid(scheme: HashScheme) -> None:
    rows = torch.ones(8, WIDTH)  # a blank image: landscape and portrait have equal rows
    landscape, portrait = (1, 2, 4), (1, 4, 2)
    a = hashes_from_features(rows, [landscape], scheme=scheme)
    b = hashes_from_features(rows, [portrait], scheme=scheme)
    assert a != b
    assert a == [hash_tensor(rows.reshape(1, 2, 4, WIDTH), scheme)]


def test_sglang_digests_are_sglangs_hash_of_each_items_rows() -> None:
    feature, grids = request([7, 8])
    digests = hashes_from_features(feature, grids, scheme=HashScheme.SGLANG)
    start = 0
    for digest, (t, h, w) in zip(digests, grids, strict=True):
        rows = feature[start : start + t * h * w]
        start += t * h * w
        raw = rows.contiguous().view(torch.uint8).numpy().tobytes()
        assert digest == int.from_bytes(hashlib.sha256(raw).digest()[:8], "big")


def test_audio_items_come_as_a_list_of_tensors() -> None:
    clips = [torch.randn(80, 30), torch.randn(80, 45), torch.randn(80, 30)]
    clips[2] = clips[0].clone()
    digests = hashes_from_features(clips)
    assert digests == [hash_tensor(c) for c in clips]
    assert digests[0] == digests[2] != digests[1]


def test_keys_name_namespace_modality_and_scheme() -> None:
    feature, grids = request([1, 2])
    keys = keys_from_features(feature, grids, namespace=NS, modality=Modality.VIDEO, scheme=HashScheme.XXH3)
    digests = hashes_from_features(feature, grids, scheme=HashScheme.XXH3)
    assert keys == [EmbeddingKey(NS, Modality.VIDEO, HashScheme.XXH3, d) for d in digests]
    assert keys == embedding_keys(digests, namespace=NS, modality=Modality.VIDEO, scheme=HashScheme.XXH3)
    other = keys_from_features(feature, grids, namespace="model-b")
    assert {k.to_key() for k in keys}.isdisjoint(k.to_key() for k in other)


@pytest.mark.parametrize(
    ("grids", "message"),
    [
        ([(1, 2, 2), (1, 3, 3), (1, 2, 2)], "item 1: grid (1, 3, 3) needs rows 4..12"),
        ([(1, 2, 2), (1, 2, 2)], "belong to no item; is an item missing, or is item 1's grid"),
        ([(1, 2, 2), (1, 2, 2), (1, 2, 2), (1, 0, 2)], "item 3: grid (1, 0, 2)"),
        ([(1, 2, 2), (1, 2, 2), (1, 2)], "item 2: grid (1, 2) is not a (t, h, w) triple"),
    ],
)
def test_rows_grid_mismatch_is_a_value_error_naming_the_item(grids: list[Grid], message: str) -> None:
    feature = torch.zeros(12, WIDTH)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hashes_from_features(feature, grids)
    cache, encode = DictCache(), CountingEncoder()
    with pytest.raises(ValueError, match="item"):
        encode_with_cache(feature, grids, encode=encode, cache=cache, namespace=NS)
    assert cache.calls == [] and encode.calls == []


def test_list_items_must_match_their_grids() -> None:
    with pytest.raises(ValueError, match=r"item 1: grid \(1, 2, 2\) needs t\*h\*w = 4 rows"):
        hashes_from_features([torch.zeros(4, 2), torch.zeros(5, 2)], [(1, 2, 2), (1, 2, 2)])
    with pytest.raises(ValueError, match="2 feature tensors but 1 grids"):
        hashes_from_features([torch.zeros(4, 2), torch.zeros(4, 2)], [(1, 2, 2)])
    with pytest.raises(TypeError, match="item 1: expected a torch.Tensor, got list"):
        hashes_from_features([torch.zeros(4, 2), [0.0]])  # type: ignore[list-item]


def test_malformed_grids_are_refused_with_the_fix() -> None:
    feature = torch.zeros(4, WIDTH)
    with pytest.raises(TypeError, match="integer tensor, got torch.float32"):
        hashes_from_features(feature, torch.tensor([[1.0, 2.0, 2.0]]))
    with pytest.raises(ValueError, match=r"shape \[N, 3\], got \[3\]"):
        hashes_from_features(feature, torch.tensor([1, 2, 2]))
    with pytest.raises(TypeError, match="item 0: grid .* holds a bool"):
        hashes_from_features(feature, [(True, 2, 2)])
    with pytest.raises(TypeError, match="item 0: grid .* holds float"):
        hashes_from_features(feature, [(1, 2.0, 2)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="needs grid_thw"):
        hashes_from_features(feature)  # type: ignore[call-overload]


# encode_with_cache


def test_only_misses_reach_the_encoder() -> None:
    cache, encode = DictCache(), CountingEncoder()
    first = encode_with_cache(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
    assert encode.items_encoded == 2
    feature, grids = request([3, 1, 2, 4])
    out = encode_with_cache(feature, grids, encode=encode, cache=cache, namespace=NS)
    assert encode.items_encoded == 4, "only items 3 and 4 were new"
    missed_features, missed_grids = encode.calls[-1]
    assert torch.equal(missed_features, request([3, 4])[0])
    assert missed_grids.tolist() == [list(g) for g in request([3, 4])[1]]
    assert torch.equal(out[1], first[0]) and torch.equal(out[2], first[1])
    again = encode_with_cache(feature, grids, encode=encode, cache=cache, namespace=NS)
    assert encode.items_encoded == 4 and len(encode.calls) == 2, "all hits: no encoder call"
    assert all(torch.equal(a, b) for a, b in zip(again, out, strict=True))


def test_identical_items_in_one_request_are_encoded_once() -> None:
    cache, encode = DictCache(), CountingEncoder()
    result = encode_with_cache_report(*request([5, 6, 5, 5, 6]), encode=encode, cache=cache, namespace=NS)
    assert encode.items_encoded == 2
    assert len(cache.calls[0][1]) == 2, "each distinct key is looked up once"
    assert len(cache.calls[-1][1]) == 2, "and inserted once"
    out = result.embeddings
    assert out[0] is out[2] is out[3] and out[1] is out[4]
    assert (result.report.items, result.report.unique, result.report.duplicates) == (5, 2, 3)


def test_the_result_names_each_items_key_in_input_order() -> None:
    ids = [2, 1, 2]
    result = encode_with_cache_report(
        *request(ids), encode=CountingEncoder(), cache=DictCache(), namespace=NS
    )
    assert result.keys == keys_from_features(*request(ids), namespace=NS)
    assert result.keys[0] == result.keys[2] != result.keys[1]


def test_results_come_back_in_input_order() -> None:
    cache, encode = DictCache(), CountingEncoder()
    encode_with_cache(*request([2, 4]), encode=encode, cache=cache, namespace=NS)
    ids = [4, 9, 2, 7, 2, 9, 1]
    feature, grids = request(ids)
    out = encode_with_cache(feature, grids, encode=encode, cache=cache, namespace=NS)
    assert len(out) == len(ids)
    for got, image_id in zip(out, ids, strict=True):
        rows, grid = item(image_id)
        assert torch.equal(got, reference(rows, grid))


def test_a_second_model_never_reuses_the_first_models_embeddings() -> None:
    cache = DictCache()
    model_a, model_b = CountingEncoder(scale=1.0), CountingEncoder(scale=-3.0)
    feature, grids = request([1, 2, 3])
    encode_with_cache(feature, grids, encode=model_a, cache=cache, namespace="model-a")
    out_b = encode_with_cache(feature, grids, encode=model_b, cache=cache, namespace="model-b")
    assert model_b.items_encoded == 3, "model B found none of model A's entries"
    for got, image_id in zip(out_b, [1, 2, 3], strict=True):
        assert torch.equal(got, reference(*item(image_id), scale=-3.0))
    out_a = encode_with_cache(feature, grids, encode=model_a, cache=cache, namespace="model-a")
    assert model_a.items_encoded == 3, "model A still hits its own entries"
    assert all(torch.equal(g, reference(*item(i))) for g, i in zip(out_a, [1, 2, 3], strict=True))
    assert len(cache.entries) == 6


def test_modality_and_scheme_are_part_of_the_key() -> None:
    cache, encode = DictCache(), CountingEncoder()
    feature, grids = request([1])
    for modality in Modality:
        for scheme in CONTENT_SCHEMES:
            encode_with_cache(
                feature,
                grids,
                encode=encode,
                cache=cache,
                namespace=NS,
                modality=modality,
                scheme=scheme,
            )
    assert encode.items_encoded == len(Modality) * len(CONTENT_SCHEMES)


def test_an_identifier_scheme_cannot_hash_features() -> None:
    with pytest.raises(ValueError, match="identifier_digest"):
        encode_with_cache(
            *request([1]),
            encode=CountingEncoder(),
            cache=DictCache(),
            namespace=NS,
            scheme=HashScheme.ID,
        )


def test_the_encoder_gets_zero_copy_views_where_it_can() -> None:
    encode = CountingEncoder()
    feature, grids = request([1, 2, 3])
    grid_tensor = torch.tensor(grids, dtype=torch.int32)
    encode_with_cache(feature, grid_tensor, encode=encode, cache=DictCache(), namespace=NS)
    assert encode.calls[0][0] is feature and encode.calls[0][1] is grid_tensor
    cache = DictCache()
    encode_with_cache(*request([1]), encode=encode, cache=cache, namespace=NS)
    encode_with_cache(feature, grid_tensor, encode=encode, cache=cache, namespace=NS)
    rows, grids_seen = encode.calls[-1]
    assert rows.data_ptr() == feature[item(1)[0].shape[0] :].data_ptr(), "a view, no copy"
    assert grids_seen.dtype == torch.int32


def test_without_a_cache_everything_is_encoded_once() -> None:
    encode = CountingEncoder()
    result = encode_with_cache_report(*request([1, 1, 2]), encode=encode, cache=None, namespace=NS)
    assert encode.items_encoded == 2
    assert result.report.hits == 0 and result.report.encoded == 2


def test_an_empty_request_touches_nothing() -> None:
    cache, encode = DictCache(), CountingEncoder()
    out = encode_with_cache(torch.zeros(0, WIDTH), [], encode=encode, cache=cache, namespace=NS)
    assert out == [] and cache.calls == [] and encode.calls == []


def test_a_bad_namespace_fails_before_any_work() -> None:
    cache, encode = DictCache(), CountingEncoder()
    with pytest.raises(InvalidKey):
        encode_with_cache(*request([1]), encode=encode, cache=cache, namespace="")
    with pytest.raises(InvalidKey):
        encode_with_cache(torch.zeros(0, WIDTH), [], encode=encode, cache=cache, namespace="")
    assert cache.calls == [] and encode.calls == []


# a failing cache never fails the encode


@pytest.mark.parametrize("op", ["batch_is_exist", "get_embeddings", "insert_batch"])
def test_a_raising_cache_recomputes_and_counts(op: str, caplog: pytest.LogCaptureFixture) -> None:
    cache, encode = DictCache(), CountingEncoder()
    encode_with_cache(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
    cache.fail.add(op)
    ids = [1, 2, 3]
    with caplog.at_level(logging.WARNING, logger="mmkey.encoder"):
        result = encode_with_cache_report(*request(ids), encode=encode, cache=cache, namespace=NS)
    assert [torch.equal(g, reference(*item(i))) for g, i in zip(result.embeddings, ids, strict=True)] == [
        True
    ] * 3
    assert result.report.cache_errors == 1
    assert f"embedding cache {op} failed" in caplog.text and "ConnectionError" in caplog.text
    if op == "insert_batch":
        assert (result.report.hits, result.report.insert_failures) == (2, 1)
    else:
        assert (result.report.hits, result.report.encoded) == (0, 3)
        assert encode.items_encoded == 2 + 3


@pytest.mark.parametrize("op", ["batch_is_exist", "get_embeddings", "insert_batch"])
def test_a_cache_that_answers_nonsense_is_a_counted_failure(op: str) -> None:
    cache, encode = DictCache(), CountingEncoder()
    encode_with_cache(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
    cache.malformed.add(op)
    result = encode_with_cache_report(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
    assert all(torch.equal(g, reference(*item(i))) for g, i in zip(result.embeddings, [1, 2], strict=True))
    if op == "insert_batch":
        assert result.report.cache_errors == 0, "all hits: nothing to insert"
        result = encode_with_cache_report(*request([3]), encode=encode, cache=cache, namespace=NS)
        assert result.report.insert_failures == 1
    assert result.report.cache_errors == 1


def test_an_entry_gone_between_exist_and_get_is_encoded() -> None:
    cache, encode = DictCache(), CountingEncoder()
    encode_with_cache(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
    evicted = keys_from_features(*request([2]), namespace=NS)[0].to_key()
    cache.forget_on_get.add(evicted)
    result = encode_with_cache_report(*request([1, 2]), encode=encode, cache=cache, namespace=NS)
    assert (result.report.hits, result.report.stale, result.report.encoded) == (1, 1, 1)
    assert torch.equal(result.embeddings[1], reference(*item(2)))
    assert result.report.cache_errors == 0
    assert evicted in cache.entries, "the recomputed entry is written back"


def test_a_closed_memory_cache_recomputes() -> None:
    cache, encode = MemoryCache(1 << 20), CountingEncoder()
    encode_with_cache(*request([1]), encode=encode, cache=cache, namespace=NS)
    cache.close()
    result = encode_with_cache_report(*request([1]), encode=encode, cache=cache, namespace=NS)
    assert torch.equal(result.embeddings[0], reference(*item(1)))
    assert result.report.cache_errors >= 1 and encode.items_encoded == 2
    with pytest.raises(StoreClosed):
        cache.batch_is_exist([])


def test_memory_cache_end_to_end() -> None:
    cache, encode = MemoryCache(1 << 20), CountingEncoder()
    ids = [3, 1, 3, 2]
    first = encode_with_cache_report(*request(ids), encode=encode, cache=cache, namespace=NS)
    second = encode_with_cache_report(*request(ids), encode=encode, cache=cache, namespace=NS)
    assert (first.report.encoded, second.report.encoded, second.report.hits) == (3, 0, 3)
    assert all(torch.equal(a, b) for a, b in zip(first.embeddings, second.embeddings, strict=True))
    assert cache.stats().entries == 3


# the caller's encoder is checked; its bugs raise


def test_an_encoder_returning_one_packed_tensor_is_told_to_split_it() -> None:
    def packed(features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return torch.zeros(int(grid_thw.shape[0]), 4)  # type: ignore[return-value]

    with pytest.raises(TypeError, match=r"one tensor of shape \[2, 4\].*split"):
        encode_with_cache(*request([1, 2]), encode=packed, cache=DictCache(), namespace=NS)


def test_an_encoder_returning_the_wrong_count_is_a_value_error() -> None:
    def short(features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return [torch.zeros(1)]

    with pytest.raises(ValueError, match="returned 1 embeddings for 2 missed items"):
        encode_with_cache(*request([1, 2]), encode=short, cache=DictCache(), namespace=NS)


def test_an_encoder_returning_non_tensors_is_a_type_error() -> None:
    def lists(features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return [[0.0]] * int(grid_thw.shape[0])  # type: ignore[list-item]

    with pytest.raises(TypeError, match="returned list for missed item 0"):
        encode_with_cache(*request([1]), encode=lists, cache=DictCache(), namespace=NS)


def test_an_encoder_failure_propagates_and_nothing_is_inserted() -> None:
    def broken(features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        raise RuntimeError("CUDA out of memory")

    cache = DictCache()
    with pytest.raises(RuntimeError, match="out of memory"):
        encode_with_cache(*request([1]), encode=broken, cache=cache, namespace=NS)
    assert "insert_batch" not in ops(cache)


def test_list_items_reach_the_encoder_as_a_list() -> None:
    seen: list[tuple[list[torch.Tensor], torch.Tensor | None]] = []

    def encode_audio(clips: list[torch.Tensor], grid_thw: torch.Tensor | None) -> list[torch.Tensor]:
        seen.append((clips, grid_thw))
        return [c.mean(dim=1) for c in clips]

    clips = [torch.randn(8, 10), torch.randn(8, 20)]
    cache = DictCache()
    encode_with_cache(clips[:1], encode=encode_audio, cache=cache, namespace=NS, modality=Modality.AUDIO)
    out = encode_with_cache(clips, encode=encode_audio, cache=cache, namespace=NS, modality=Modality.AUDIO)
    assert seen[-1][0][0] is clips[1] and len(seen[-1][0]) == 1 and seen[-1][1] is None
    assert torch.equal(out[0], clips[0].mean(dim=1)) and torch.equal(out[1], clips[1].mean(dim=1))


# the report


def test_reports_add_up() -> None:
    cache, encode = DictCache(), CountingEncoder()
    total = EncodeReport()
    for ids in ([1, 2], [2, 3, 3], [1]):
        total += encode_with_cache_report(*request(ids), encode=encode, cache=cache, namespace=NS).report
    assert (total.items, total.unique, total.hits, total.encoded) == (6, 5, 2, 3)
    assert (total.saved, total.duplicates, total.inserted) == (3, 1, 3)
    assert total.hit_rate == pytest.approx(2 / 5)
    assert total.hashed_bytes == sum(item(i)[0].numel() * 4 for i in [1, 2, 2, 3, 3, 1])
    assert total.hash_seconds > 0 and total.encode_seconds > 0
    assert EncodeReport().hit_rate == 0.0


@settings(max_examples=60, deadline=None)
@given(
    cached=st.sets(st.integers(0, 7), max_size=8),
    ids=st.lists(st.integers(0, 7), max_size=10),
)
def test_any_request_gets_its_own_embeddings_and_encodes_each_miss_once(
    cached: set[int], ids: list[int]
) -> None:
    cache, encode = DictCache(), CountingEncoder()
    if cached:
        encode_with_cache(*request(sorted(cached)), encode=encode, cache=cache, namespace=NS)
    before = encode.items_encoded
    out = encode_with_cache(*request(ids), encode=encode, cache=cache, namespace=NS)
    assert len(out) == len(ids)
    assert all(torch.equal(g, reference(*item(i))) for g, i in zip(out, ids, strict=True))
    assert encode.items_encoded - before == len(set(ids) - cached)


class DeviceEncoder(CountingEncoder):
    """A CountingEncoder whose outputs land on `device` (meta stands in for a GPU here)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def __call__(self, features: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        return [e.to(self.device) for e in super().__call__(features, grid_thw)]


def cache_holding(ids: Sequence[int]) -> MemoryCache:
    cache = MemoryCache(1 << 20)
    encode_with_cache(*request(ids), encode=CountingEncoder(), cache=cache, namespace=NS)
    return cache


def devices(embeddings: Sequence[torch.Tensor]) -> set[str]:
    return {str(e.device) for e in embeddings}


def test_a_partly_cached_request_comes_back_on_the_encoders_device() -> None:
    cache, encode = cache_holding([1]), DeviceEncoder("meta")
    result = encode_with_cache_report(*request([1, 2, 1]), encode=encode, cache=cache, namespace=NS)
    assert (result.report.hits, result.report.encoded) == (1, 1)
    assert devices(result.embeddings) == {"meta"}
    assert result.embeddings[0] is result.embeddings[2], "duplicates still share one tensor"
    assert result.embeddings[0].shape == reference(*item(1)).shape


def test_the_device_argument_puts_every_embedding_there() -> None:
    cache = cache_holding([1])
    out = encode_with_cache(
        *request([1, 2]), encode=CountingEncoder(), cache=cache, namespace=NS, device="meta"
    )
    assert devices(out) == {"meta"}
    hits_only = encode_with_cache(
        *request([1, 2]),
        encode=CountingEncoder(),
        cache=cache,
        namespace=NS,
        device=torch.device("meta"),
    )
    assert devices(hits_only) == {"meta"}
    on_cpu = encode_with_cache(
        *request([1, 3]), encode=CountingEncoder(), cache=cache, namespace=NS, device="cpu"
    )
    assert devices(on_cpu) == {"cpu"}
    assert torch.equal(on_cpu[1], reference(*item(3)))


def test_every_hit_comes_back_on_the_features_device() -> None:
    cache = cache_holding([1, 2])
    result = encode_with_cache_report(
        *request([2, 1]), encode=DeviceEncoder("meta"), cache=cache, namespace=NS
    )
    assert result.report.encoded == 0
    assert devices(result.embeddings) == {"cpu"}


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [(0, TypeError, "torch.device or device text"), ("gpu:0", ValueError, "'gpu:0' is not")],
)
def test_a_bad_device_is_refused_before_any_work(device: Any, error: type, match: str) -> None:
    encode, cache = CountingEncoder(), DictCache()
    with pytest.raises(error, match=match):
        encode_with_cache(*request([1]), encode=encode, cache=cache, namespace=NS, device=device)
    assert encode.calls == [] and cache.calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_encoder_outputs_and_cpu_hits_come_back_on_one_device() -> None:  # pragma: no cover
    cache = cache_holding([1])
    out = encode_with_cache(*request([1, 2]), encode=DeviceEncoder("cuda"), cache=cache, namespace=NS)
    assert devices(out) == {"cuda:0"}
    torch.cat(out)  # the call that failed on partial hits
    assert torch.equal(out[0].cpu(), reference(*item(1)))
    on_cpu = encode_with_cache(
        *request([1, 3]), encode=DeviceEncoder("cuda"), cache=cache, namespace=NS, device="cpu"
    )
    assert devices(on_cpu) == {"cpu"}
    feature, grids = request([1, 2])
    all_hits = encode_with_cache(
        feature.cuda(), grids, encode=DeviceEncoder("cuda"), cache=cache, namespace=NS
    )
    assert devices(all_hits) == {"cuda:0"}
