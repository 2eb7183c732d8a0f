"""Single-flight in `encode_with_cache` and its async twin, over caches that claim.

A scripted claiming cache shows the order of the steps (won and unclaimed keys encoded and
released before any wait, held keys waited for, what did not land encoded) and that a claim
is released when the encode fails. Callers of one `MooncakeCache` (on the fake store) in one
process encode each item once between them; wrappers pass claims through.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mmkey import AsyncCache, CacheKey, MemoryCache, MooncakeCache
from mmkey.cache.mooncake import MooncakeConfig
from mmkey.cache.protocol import AsyncClaimingCache, Claim, ClaimingCache
from mmkey.cache.tiered import TieredCache
from mmkey.encoder import aencode_with_cache_report, encode_with_cache_report
from mmkey.metrics import MeteredCache
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from tests._support import wait_until

NS = "claims-model"
MiB = 1 << 20


def burst(n: int) -> list[torch.Tensor]:
    return [torch.full((2, 3), float(i)) for i in range(n)]


def model(features: list[torch.Tensor], _grid: object) -> list[torch.Tensor]:
    return [f.sum(dim=0) * 3 for f in features]


class ScriptedClaims(MemoryCache):
    """A memory cache that answers claims from a script (by item value) and records each step."""

    def __init__(self, answers: dict[int, Claim], landed: dict[int, torch.Tensor], wait: float = 1.0) -> None:
        super().__init__(1 << 20)
        self.answers, self.landed, self.wait = answers, landed, wait
        self.steps: list[tuple[str, list[int]]] = []
        self.ids: dict[str, int] = {}

    def learn(self, keys: Sequence[CacheKey], features: list[torch.Tensor]) -> None:
        self.ids.update({k.to_key(): int(f[0, 0].item()) for k, f in zip(keys, features, strict=True)})

    def _ids(self, keys: Sequence[CacheKey]) -> list[int]:
        return [self.ids[k.to_key()] for k in keys]

    @property
    def claim_wait(self) -> float:
        return self.wait

    def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        self.steps.append(("claim", self._ids(keys)))
        return [self.answers.get(i, Claim.UNCLAIMED) for i in self._ids(keys)]

    def release(self, keys: Sequence[CacheKey]) -> None:
        self.steps.append(("release", self._ids(keys)))

    def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        self.steps.append(("wait", self._ids(keys)))
        return [self.landed.get(i) for i in self._ids(keys)]


def keyed(cache: ScriptedClaims, features: list[torch.Tensor]) -> None:
    from mmkey.digest import HashScheme, Modality
    from mmkey.encoder._plan import EncodePlan

    plan = EncodePlan.build(features, None, namespace=NS, modality=Modality.IMAGE, scheme=HashScheme.BLAKE3)
    cache.learn(plan.keys, features)


def test_won_keys_are_encoded_and_released_before_held_keys_are_waited_for() -> None:
    features = burst(4)
    landed = {2: model([features[2]], None)[0]}
    cache = ScriptedClaims({0: Claim.WON, 2: Claim.HELD, 3: Claim.HELD}, landed)
    keyed(cache, features)
    assert isinstance(cache, ClaimingCache)
    calls: list[list[int]] = []

    def encode(fs: list[torch.Tensor], grid: object) -> list[torch.Tensor]:
        calls.append([int(f[0, 0].item()) for f in fs])
        cache.steps.append(("encode", calls[-1]))
        return model(fs, grid)

    result = encode_with_cache_report(features, encode=encode, cache=cache, namespace=NS)
    assert cache.steps == [
        ("claim", [0, 1, 2, 3]),
        ("encode", [0, 1]),  # won and unclaimed: encoded at once, before any wait
        ("release", [0]),
        ("wait", [2, 3]),
        ("encode", [3]),  # held, but its entry never landed
    ]
    assert [torch.equal(e, r) for e, r in zip(result.embeddings, model(features, None), strict=True)] == [
        True
    ] * 4
    report = result.report
    assert (report.encoded, report.coalesced, report.hits) == (3, 1, 0)
    assert cache.stats().inserts == 3


def test_a_claim_is_released_when_the_encode_fails() -> None:
    features = burst(2)
    cache = ScriptedClaims({0: Claim.WON, 1: Claim.WON}, {})
    keyed(cache, features)

    def broken(fs: list[torch.Tensor], grid: object) -> list[torch.Tensor]:
        raise RuntimeError("the tower fell over")

    with pytest.raises(RuntimeError, match="tower"):
        encode_with_cache_report(features, encode=broken, cache=cache, namespace=NS)
    assert cache.steps == [("claim", [0, 1]), ("release", [0, 1])]


def test_claims_off_or_unsupported_take_no_claim_step() -> None:
    features = burst(2)
    off = ScriptedClaims({0: Claim.WON}, {}, wait=0.0)
    keyed(off, features)
    encode_with_cache_report(features, encode=model, cache=off, namespace=NS)
    assert off.steps == []
    plain = MemoryCache(1 << 20)
    assert not isinstance(plain, ClaimingCache)
    assert encode_with_cache_report(features, encode=model, cache=plain, namespace=NS).report.encoded == 2


def test_the_async_twin_claims_through_async_cache() -> None:
    features = burst(3)
    cache = ScriptedClaims({0: Claim.WON, 1: Claim.HELD}, {1: model([features[1]], None)[0]})
    keyed(cache, features)
    wrapped = AsyncCache(cache)
    assert isinstance(wrapped, AsyncClaimingCache)
    assert wrapped.claim_wait == 1.0
    result = asyncio.run(aencode_with_cache_report(features, encode=model, cache=wrapped, namespace=NS))
    assert [s for s, _ in cache.steps] == ["claim", "release", "wait"]
    assert (result.report.encoded, result.report.coalesced) == (2, 1)
    assert AsyncCache(MemoryCache(1 << 20)).claim_wait == 0.0


def test_metered_and_tiered_caches_pass_claims_through() -> None:
    from prometheus_client import CollectorRegistry

    cache = ScriptedClaims({0: Claim.WON}, {})
    metered = MeteredCache(cache, registry=CollectorRegistry())
    assert metered.claim_wait == 1.0
    tiered = TieredCache(MemoryCache(1 << 20), metered)
    assert tiered.claim_wait == 1.0
    assert TieredCache(MemoryCache(1 << 20), MemoryCache(1 << 20)).claim_wait == 0.0
    features = burst(1)
    keyed(cache, features)
    encode_with_cache_report(features, encode=model, cache=tiered, namespace=NS)
    assert [s for s, _ in cache.steps] == ["claim", "release"]


def test_callers_of_one_cache_in_one_process_encode_each_item_once() -> None:
    features = burst(6)
    encoded: list[int] = []
    lock = threading.Lock()
    gate = threading.Barrier(4, timeout=30)

    def encode(fs: list[torch.Tensor], grid: object) -> list[torch.Tensor]:
        with lock:
            encoded.extend(int(f[0, 0].item()) for f in fs)
        threading.Event().wait(0.05)  # a tower's time: the other callers find the keys claimed
        return model(fs, grid)

    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 * MiB, timeout=5.0)
        with MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as cache:

            def call(_: int) -> list[torch.Tensor]:
                gate.wait()
                return encode_with_cache_report(features, encode=encode, cache=cache, namespace=NS).embeddings

            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(call, range(4)))
            assert sorted(encoded) == list(range(6))
            want = model(features, None)
            assert all(torch.equal(a, b) for got in results for a, b in zip(got, want, strict=True))
            assert cache.stats().claims_won == 6


def test_two_async_servers_on_two_clients_encode_each_item_once() -> None:
    features = burst(4)
    encoded: list[int] = []

    async def encode(fs: list[torch.Tensor], grid: object) -> list[torch.Tensor]:
        encoded.extend(int(f[0, 0].item()) for f in fs)
        # until the other server claimed too (and found the keys held): no entry lands before
        claimed = await asyncio.to_thread(
            wait_until, lambda: master.calls["batch_put_session_start"] >= 2, 10.0
        )
        assert claimed, "the other server never claimed"
        return model(fs, grid)

    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 * MiB, timeout=5.0)
        with (
            MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as one,
            MooncakeCache(config, keyring=None, store_class=FakeMooncakeStore) as two,
        ):

            async def both() -> list[list[torch.Tensor]]:
                calls = [
                    aencode_with_cache_report(features, encode=encode, cache=AsyncCache(c), namespace=NS)
                    for c in (one, two)
                ]
                return [r.embeddings for r in await asyncio.gather(*calls)]

            results = asyncio.run(both())
            assert sorted(encoded) == list(range(4))
            want = model(features, None)
            assert all(torch.equal(a, b) for got in results for a, b in zip(got, want, strict=True))
            assert one.stats().claims_won + two.stats().claims_won == 4
