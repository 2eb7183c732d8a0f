"""The master's own counts of what the store holds, read from its metrics endpoint."""

from __future__ import annotations

import pytest

from mmkey.cache.mooncake import _master_http
from mmkey.cache.mooncake.usage import StoreUsage, parse_master_metrics, read_master_usage
from mmkey.testing.mooncake_master import MasterProcess

SAMPLE = """# HELP master_key_count Total number of keys managed by the master
# TYPE master_key_count gauge
master_key_count 7
master_allocated_bytes 4096
master_total_capacity_bytes 1.34217728e+08
segment_total_capacity_bytes{segment="127.0.0.1:1"} 67108864
segment_total_capacity_bytes{segment="127.0.0.1:2"} 67108864
master_key_count_other{x="1"} 99
"""


def test_parses_the_masters_counts() -> None:
    assert parse_master_metrics(SAMPLE) == StoreUsage(
        keys=7, allocated_bytes=4096, capacity_bytes=134217728, segments=2
    )
    assert parse_master_metrics(SAMPLE.replace("master_key_count 7\n", "")) is None
    assert parse_master_metrics("") is None


def test_segment_names_are_the_labelled_capacity_samples() -> None:
    assert _master_http.segment_names(SAMPLE) == {"127.0.0.1:1", "127.0.0.1:2"}
    other_label = 'segment_total_capacity_bytes{segment="h:1",tier="x"} 1\n'
    assert _master_http.segment_names(other_label + "segment_total_capacity_bytes 5\n") == set()


def test_a_master_that_does_not_answer_is_none() -> None:
    assert _master_http.read_metrics("127.0.0.1", 9, timeout=0.5) is None
    assert _master_http.read_health("127.0.0.1", 9, timeout=0.5) is None


def test_a_silent_or_malformed_endpoint() -> None:
    assert read_master_usage("127.0.0.1:9", timeout=0.5) is None
    with pytest.raises(ValueError, match="host:port"):
        read_master_usage("nohost")


@pytest.mark.mooncake
def test_reads_a_real_master(mooncake_master: MasterProcess) -> None:
    from mooncake.store import MooncakeDistributedStore

    address = f"127.0.0.1:{mooncake_master.metrics_port}"
    empty = read_master_usage(address)
    assert empty == StoreUsage(keys=0, allocated_bytes=0, capacity_bytes=0, segments=0)
    health = _master_http.read_health("127.0.0.1", mooncake_master.metrics_port)
    assert health is not None and health.get("service_ready") is True
    store = MooncakeDistributedStore()
    assert (
        store.setup("127.0.0.1", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", mooncake_master.address) == 0
    )
    try:
        for i in range(3):
            assert store.put(f"usage-{i}", b"v" * 1000) == 0
        usage = read_master_usage(address)
        assert usage is not None
        assert (usage.keys, usage.segments, usage.capacity_bytes) == (3, 1, 32 << 20)
        assert usage.allocated_bytes >= 3000
        text = _master_http.read_metrics("127.0.0.1", mooncake_master.metrics_port)
        assert text is not None and len(_master_http.segment_names(text)) == 1
    finally:
        store.close()


def test_usage_is_an_immutable_keyword_only_record() -> None:
    usage = StoreUsage(keys=1, allocated_bytes=2, capacity_bytes=3, segments=1)
    with pytest.raises(TypeError):
        StoreUsage(1, 2, 3, 1)  # type: ignore[call-arg]  # four ints in a row are easy to swap
    assert not hasattr(usage, "__dict__"), "slotted"
    with pytest.raises(AttributeError):
        usage.keys = 5  # type: ignore[misc]
