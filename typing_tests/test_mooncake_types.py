"""The Mooncake adapter and the stubbed binding, as mypy and pyright see them."""

from __future__ import annotations

import torch
from mooncake.store import MooncakeDistributedStore, ReplicaDescriptor, ReplicateConfig
from typing_extensions import assert_type

from mmkey import (
    AsyncCache,
    CacheStats,
    EmbeddingCache,
    EmbeddingKey,
    MemoryCache,
    MMHash,
    MooncakeCache,
    MooncakeConfig,
    TieredCache,
)
from mmkey.cache.health import CacheHealth


def adapter_types(config: MooncakeConfig, key: EmbeddingKey, t: torch.Tensor, h: MMHash) -> None:
    cache = MooncakeCache(config)
    as_protocol: EmbeddingCache = cache
    TieredCache(MemoryCache(1 << 20), cache)
    AsyncCache(cache)
    assert_type(cache.batch_is_exist([key]), list[bool])
    assert_type(cache.get_embeddings([key]), list[torch.Tensor | None])
    assert_type(cache.insert_batch([key], [t]), list[bool])
    assert_type(cache.prefetch([key]), int)
    assert_type(cache.stats(), CacheStats)
    assert_type(cache.is_connected(), bool)
    assert_type(cache.health(), CacheHealth)
    assert_type(config.replica_num, int)
    MooncakeConfig(master_server_address="h:1", replica_num="2")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    assert_type(MooncakeConfig.from_env(), MooncakeConfig)
    assert_type(config.setup_args(), tuple[str, str, int, int, str, str, str])
    with MooncakeCache(config) as scoped:
        assert_type(scoped, MooncakeCache)
    cache.batch_is_exist([h])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.get_embeddings([key.to_key()])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    cache.insert_batch([key], [t.numpy()])  # type: ignore[list-item]  # pyright: ignore[reportArgumentType]
    MooncakeCache("127.0.0.1:50051")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    MooncakeConfig("127.0.0.1:50051")  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    assert_type(config.timeout, float)
    assert_type(config.setup_timeout, float)
    config.timeout = 1.0  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
    MooncakeConfig(master_server_address="h:1", deadline=1.0)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    del as_protocol


def binding_types(store: MooncakeDistributedStore) -> None:
    assert_type(store.setup("h", "P2PHANDSHAKE", 1, 1, "tcp", "", "h:1"), int)
    assert_type(store.get("k"), bytes)
    assert_type(store.get_batch(["k"]), list[bytes])
    assert_type(store.batch_is_exist(["k"]), list[int])
    assert_type(store.put("k", b"v"), int)
    assert_type(store.batch_get_into(["k"], [0], [1]), list[int])
    assert_type(store.batch_upsert_from(["k"], [0], [1]), list[int])
    store.put("k", b"v", ReplicateConfig())
    assert_type(store.batch_get_replica_desc(["k"]), dict[str, list[ReplicaDescriptor]])
    assert_type(
        store.get_replica_desc("k")[0].get_memory_descriptor().buffer_descriptor.transport_endpoint, str
    )
    store.get(key="k")  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
    store.put(5, b"v")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    store.batch_is_exist("k")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    store.put("k", "text")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def fake_store_types(config: MooncakeConfig) -> None:
    from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore

    store: MooncakeDistributedStore = FakeMooncakeStore()  # a substitute, as the stub types it
    assert_type(store.batch_get_into(["k"], [0], [1]), list[int])
    MooncakeCache(config, store_class=FakeMooncakeStore)
    MooncakeCache(config, store_class=FakeMooncakeMaster)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    MooncakeCache(config, store_class=FakeMooncakeStore())  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    master = FakeMooncakeMaster()
    master.fail_next("get_size", code="-900")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    assert_type(master.address, str)
    master.close()
