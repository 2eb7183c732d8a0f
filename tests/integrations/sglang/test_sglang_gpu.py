"""MMKeyEmbeddingStore under SGLang's controller on a CUDA device: what the CPU tests stand in for.

Pinned pools (as SGLang creates them), embeddings copied in from CUDA by SGLang's own
``store_to_pool_async`` and back out by ``load_to_device_async``, and SGLang's GPU feature
hash. Runs in SGLang's environment on a machine with an NVIDIA GPU (``scripts/gpu-check.sh``);
skips elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests._support import local_config
from tests.integrations.sglang.sglang_support import require_sglang, unpinned_controller, wait_until

require_sglang()

import torch  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from sglang.srt.managers import mm_utils  # noqa: E402
from sglang.srt.multimodal.modality import Modality as SGLangModality  # noqa: E402

from mmkey import HashScheme, hash_tensor  # noqa: E402
from mmkey.integrations.sglang import MMKeyEmbeddingStore  # noqa: E402
from mmkey.integrations.sglang._hash import feature_hash  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.mooncake]

DIMS = {"image": 64, "audio": 32}
DTYPE = torch.bfloat16


@pytest.fixture
def stores(
    mooncake_master_session: MasterProcess,
) -> Iterator[tuple[MMKeyEmbeddingStore, MMKeyEmbeddingStore]]:
    made = [
        MMKeyEmbeddingStore(namespace="gpu-model", config=local_config(mooncake_master_session, timeout=2.0))
        for _ in range(2)
    ]
    yield made[0], made[1]
    for store in made:
        store.close()


def test_cuda_embeddings_round_trip_through_pinned_pools(
    stores: tuple[MMKeyEmbeddingStore, MMKeyEmbeddingStore],
) -> None:
    image = SGLangModality.IMAGE
    writer_store, reader_store = stores
    pixels = torch.randn(4, 3, 224, 224, device="cuda")
    mm_hash = str(mm_utils.hash_feature(pixels))  # SGLang's GPU hash of a CUDA feature
    embedding = torch.randn(300, 64, device="cuda").to(DTYPE)
    with (
        unpinned_controller(writer_store, DIMS, DTYPE, pinned=True) as writer,
        unpinned_controller(reader_store, DIMS, DTYPE, pinned=True) as reader,
    ):
        assert writer.vision_pool.tensor.is_pinned()
        writer.wait_store_to_pool(writer.store_to_pool_async([mm_hash], [embedding], image))
        writer.insert_batch([mm_hash], image)
        assert wait_until(lambda: writer.entries[mm_hash].ref_count == 0, 30)
        assert asyncio.run(reader.batch_is_exist([mm_hash])) == [True]
        reader.prefetch("req", [mm_hash], [300], image)
        assert wait_until(lambda: reader.check_prefetch_progress("req"), 30)
        assert reader.has_local_embedding(mm_hash)
        out = torch.zeros(300, 64, device="cuda", dtype=DTYPE)
        handle = reader.load_to_device_async(mm_hash, out, 0)
        assert handle is not None
        reader.wait_load_to_device([handle])
        assert torch.equal(out, embedding)
    assert reader_store.stats().hits == 1


def test_sglangs_gpu_hash_is_64_bit_and_blake3_hashes_a_cuda_feature_as_on_the_cpu() -> None:
    feature = torch.randn(16, 1176, device="cuda")
    assert 0 <= mm_utils.tensor_hash([feature]) < 2**64  # SGLang's Triton hash
    assert feature_hash([feature]) == int(hash_tensor(feature.cpu(), HashScheme.BLAKE3))
