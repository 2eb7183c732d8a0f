"""Pins of the connector's edges that its tests leave open (found by a mutation pass): what a
producer's announcement may hold and why a consumer ignores one, the memory store shared by
the connectors of one process, and what `shutdown` does twice.

Announcements are read directly (`read_announcement`); the memory store's tests build
connectors with vLLM's factory, as the connector tests do.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import threading
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import producer_only_config, require_vllm, vllm_config

require_vllm()

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402

from mmkey import EmbeddingKey, HashScheme, MemoryCache, Modality, StoreClosed, identifier_digest  # noqa: E402
from mmkey.entry.auth import EntryKeyring  # noqa: E402
from mmkey.integrations.vllm import MMKeyECConnector  # noqa: E402
from mmkey.integrations.vllm import _connector as connector_module  # noqa: E402
from mmkey.integrations.vllm._announce import announce, read_announcement  # noqa: E402

NAMESPACE = "announce-pins"
NOW = dt.datetime(2026, 6, 1, tzinfo=dt.timezone.utc).timestamp()
CURRENT = bytes(range(32))
OLD = hashlib.sha256(b"announce-pins old").digest()
STRANGER = hashlib.sha256(b"announce-pins stranger").digest()

MAX_KEYS = 1024
"""Keys read of one announcement (the documented bound; written out, not imported)."""
NOT_A_LIST = f"'encoded' is not a list of at most {MAX_KEYS} keys"
NOT_KEY_TEXT = "'encoded' holds something that is not key text"
FOREIGN = "names keys of another namespace or no key"
UNSIGNED = "unsigned, and this fleet has an entry secret"
NOT_ACCEPTED = "signed with a secret this fleet does not accept"


def key_text(name: str, namespace: str = NAMESPACE) -> str:
    return EmbeddingKey(namespace, Modality.IMAGE, HashScheme.ID, identifier_digest(name)).to_key()


def params(encoded: object, **signed: object) -> dict[str, Any]:
    return {"mmkey": {"encoded": encoded, **signed}}


def test_an_announcement_of_at_most_max_keys_is_read_and_one_more_is_ignored() -> None:
    """`MAX_KEYS` keys are read; one key more and the whole announcement is ignored."""
    texts = [key_text(f"k{i}") for i in range(MAX_KEYS + 1)]
    read = read_announcement(params(texts[:MAX_KEYS]), NAMESPACE, None, now=NOW)
    assert read.ignored is None and read.keys == frozenset(texts[:MAX_KEYS])
    over = read_announcement(params(texts), NAMESPACE, None, now=NOW)
    assert over.keys == frozenset() and over.ignored == NOT_A_LIST


def test_key_texts_of_more_than_1024_characters_are_not_key_text() -> None:
    """A text of 1024 characters is read (here: no key of the namespace); of 1025, it is not
    key text at all."""
    assert read_announcement(params(["x" * 1024]), NAMESPACE, None, now=NOW).ignored == FOREIGN
    assert read_announcement(params(["x" * 1025]), NAMESPACE, None, now=NOW).ignored == NOT_KEY_TEXT


@pytest.mark.parametrize(
    "encoded,why,keys",
    [
        (key_text("a"), NOT_A_LIST, set()),
        ([key_text("a"), 7], NOT_KEY_TEXT, set()),
        (["mmk1@broken"], FOREIGN, set()),
        ([key_text("a"), key_text("b", "another-model")], FOREIGN, {key_text("a")}),
    ],
    ids=["a-text-not-a-list", "not-a-text", "not-a-key", "foreign"],
)
def test_an_ignored_announcement_says_why(encoded: object, why: str, keys: set[str]) -> None:
    """The reason an announcement (or part of it) is ignored names what is wrong with it; of
    a list of key texts, the keys of this namespace are still read."""
    read = read_announcement(params(encoded), NAMESPACE, None, now=NOW)
    assert read.ignored == why and read.keys == keys


def test_under_a_secret_an_announcement_missing_its_key_id_or_mac_is_unsigned() -> None:
    """Under a fleet secret, an announcement without its ``key_id`` or without its ``mac`` is
    refused as unsigned."""
    keyring = EntryKeyring.from_secrets(CURRENT)
    signed = announce([key_text("a")], keyring)["mmkey"]
    for dropped in ("key_id", "mac"):
        fields = {k: v for k, v in signed.items() if k != dropped}
        read = read_announcement({"mmkey": fields}, NAMESPACE, keyring, now=NOW)
        assert read.keys == frozenset() and read.ignored == UNSIGNED, dropped
    assert read_announcement({"mmkey": signed}, NAMESPACE, keyring, now=NOW).keys == {key_text("a")}


def test_an_announcement_signed_with_an_expired_or_unknown_secret_is_refused() -> None:
    """A previous secret counts until its ``not_after``; after it, and for a secret the fleet
    never held, the announcement is refused as not accepted."""
    not_after = dt.datetime.fromtimestamp(NOW + 60, dt.timezone.utc)
    reader = EntryKeyring.from_secrets(CURRENT, (OLD, not_after))
    old_signed = announce([key_text("a")], EntryKeyring.from_secrets(OLD))
    assert read_announcement(old_signed, NAMESPACE, reader, now=NOW).keys == {key_text("a")}
    late = read_announcement(old_signed, NAMESPACE, reader, now=NOW + 61)
    assert late.keys == frozenset() and late.ignored == NOT_ACCEPTED
    stranger = announce([key_text("a")], EntryKeyring.from_secrets(STRANGER))
    unknown = read_announcement(stranger, NAMESPACE, reader, now=NOW)
    assert unknown.keys == frozenset() and unknown.ignored == NOT_ACCEPTED


def test_the_announcement_mac_is_format_v1() -> None:
    """The signed announcement is a wire format between releases: its keys sorted and
    deduplicated, the id and MAC of a known secret are fixed values."""
    assert announce(["mmk1@b", "mmk1@a", "mmk1@b"], EntryKeyring.from_secrets(CURRENT)) == {
        "mmkey": {
            "encoded": ["mmk1@a", "mmk1@b"],
            "key_id": "895fc3a8698d76e5",
            "mac": "85bb7007ed7168ae592d2d06ac80f4d9e90e2d293d8ef382a6035e669f0df1cb",
        }
    }


def usable(cache: object) -> bool:
    """Whether a memory store still answers (a closed one raises `StoreClosed`)."""
    assert isinstance(cache, MemoryCache)
    try:
        cache.batch_is_exist([EmbeddingKey.from_key(key_text("probe"))])
    except StoreClosed:
        return False
    return True


def test_the_memory_store_is_shared_until_the_last_connector_of_its_namespace_shuts_down() -> None:
    """Connectors of one namespace in one process share one memory store: it stays open while
    any of them is up, a second `shutdown` of one changes nothing, and the last one closes it."""
    cfg = vllm_config("ec_both", namespace="shared-memory-pins", store="memory", memory_max_bytes="8MB")
    made = [
        MMKeyECConnector(cfg, ECConnectorRole.SCHEDULER),
        MMKeyECConnector(cfg, ECConnectorRole.WORKER),
        MMKeyECConnector(cfg, ECConnectorRole.SCHEDULER),
    ]
    try:
        cache = made[0].cache
        assert all(c.cache is cache for c in made)
        made[0].shutdown()
        made[0].shutdown()  # idempotent: not a second release
        assert usable(cache)
        made[1].shutdown()
        assert usable(cache)
        made[2].shutdown()
        assert not usable(cache)
        again = MMKeyECConnector(cfg, ECConnectorRole.SCHEDULER)
        try:
            assert again.cache is not cache and usable(again.cache)
        finally:
            again.shutdown()
    finally:
        for c in made:
            c.shutdown()


def new_savers(before: set[threading.Thread]) -> int:
    """How many saver threads run now that did not before."""
    return sum(1 for t in threading.enumerate() if t.name == "mmkey-vllm-saver" and t not in before)


@pytest.mark.parametrize("side", ["producer-scheduler", "consumer-worker"])
def test_only_a_producers_worker_starts_a_saver(side: str) -> None:
    """A producer's scheduler side and a consumer's worker save nothing: neither starts the
    saver's thread; a producer's worker does."""
    before = set(threading.enumerate())
    if side == "producer-scheduler":
        cfg, role = producer_only_config(namespace="saver-pins", store="memory"), ECConnectorRole.SCHEDULER
    else:
        cfg, role = vllm_config("ec_consumer", namespace="saver-pins", store="memory"), ECConnectorRole.WORKER
    quiet = MMKeyECConnector(cfg, role)
    try:
        assert new_savers(before) == 0 and quiet.flush_saves(0.0)
        saving = MMKeyECConnector(
            producer_only_config(namespace="saver-pins", store="memory"), ECConnectorRole.WORKER
        )
        try:
            assert new_savers(before) == 1
        finally:
            saving.shutdown()
    finally:
        quiet.shutdown()


def test_the_identifier_check_is_told_whether_the_namespace_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With tower LoRA only a namespace given in the extra config makes the setup safe, so the
    check must hear whether there was one (the check itself: `test_vllm_identity_pins.py`)."""
    told: list[bool] = []

    def check(_: object, *, explicit_namespace: bool) -> None:
        told.append(explicit_namespace)

    monkeypatch.setattr(connector_module, "check_identifiers", check)
    MMKeyECConnector(
        vllm_config("ec_consumer", namespace="check-pins", store="memory"), ECConnectorRole.SCHEDULER
    ).shutdown()
    with pytest.raises(ValueError, match="no model config to derive the cache namespace"):
        MMKeyECConnector(vllm_config("ec_consumer", store="memory"), ECConnectorRole.SCHEDULER)
    assert told == [True, False]
