"""The demo's parts: the synthetic stream, Qwen2-VL patchification, the vision encoder,
and run_demo over a real MemoryCache."""

from __future__ import annotations

import pytest
import torch

from mmkey import MemoryCache
from mmkey.cli.demo import (
    StreamConfig,
    TinyVisionEncoder,
    VisionConfig,
    patchify,
    run_demo,
    synthetic_requests,
)
from mmkey.cli.demo.stream import synthetic_image
from mmkey.encoder import EncodeReport, hashes_from_features

SMALL = VisionConfig(dim=32, depth=1, heads=2, out_dim=48)


def test_the_stream_is_the_same_on_every_run_and_repeats_images() -> None:
    config = StreamConfig(requests=12, pool=6)
    first, second = list(synthetic_requests(config)), list(synthetic_requests(config))
    assert [r.image_ids for r in first] == [r.image_ids for r in second]
    assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(first, second, strict=True))
    ids = [i for r in first for i in r.image_ids]
    assert len(set(ids)) < len(ids), "images repeat across requests"
    other = list(synthetic_requests(StreamConfig(requests=12, pool=6, seed=1)))
    assert [r.image_ids for r in other] != [r.image_ids for r in first]


def test_a_repeated_image_has_the_same_bytes_and_so_the_same_digest() -> None:
    requests = list(synthetic_requests(StreamConfig(requests=20, pool=3)))
    digests: dict[int, set[int]] = {}
    for r in requests:
        for image_id, digest in zip(
            r.image_ids, hashes_from_features(r.pixel_values, r.grid_thw), strict=True
        ):
            digests.setdefault(image_id, set()).add(digest)
    assert all(len(d) == 1 for d in digests.values())
    assert len({d for ds in digests.values() for d in ds}) == len(digests)


def test_patchify_lays_rows_out_like_the_qwen2_vl_processor() -> None:
    config = VisionConfig()
    p = config.patch
    # each patch is filled with its (row, col) so the row order can be read back
    rows, cols = 4, 6
    image = torch.zeros(3, rows * p, cols * p, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            image[0, r * p : (r + 1) * p, c * p : (c + 1) * p] = r
            image[1, r * p : (r + 1) * p, c * p : (c + 1) * p] = c
    features, grid = patchify(image, config)
    assert grid == (1, rows, cols)
    assert features.shape == (rows * cols, 3 * 2 * p * p)
    per_channel = features.view(rows * cols, 3, 2 * p * p)
    std, mean = 0.26862954, 0.48145466
    r_of = ((per_channel[:, 0, 0] * std + mean) * 255).round().long().tolist()
    std, mean = 0.26130258, 0.4578275
    c_of = ((per_channel[:, 1, 0] * std + mean) * 255).round().long().tolist()
    # 2x2 merge windows are contiguous, windows in row-major order
    assert list(zip(r_of, c_of, strict=True))[:8] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (0, 2),
        (0, 3),
        (1, 2),
        (1, 3),
    ]


def test_synthetic_images_are_sized_for_patch_and_merge() -> None:
    for image_id in range(6):
        image = synthetic_image(image_id)
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert image.shape[1] % 28 == 0 and image.shape[2] % 28 == 0


def test_the_encoder_gives_one_merged_embedding_per_item() -> None:
    model = TinyVisionEncoder(SMALL)
    request = next(synthetic_requests(StreamConfig(requests=1, max_images=3, seed=4), SMALL))
    grid = torch.tensor(request.grid_thw)
    out = model.encode(request.pixel_values, grid)
    assert [tuple(e.shape) for e in out] == [(t * h * w // 4, 48) for t, h, w in request.grid_thw]
    assert not any(e.requires_grad for e in out)
    again = TinyVisionEncoder(SMALL).encode(request.pixel_values, grid)
    assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True)), "fixed seed: same weights"
    other = TinyVisionEncoder(VisionConfig(dim=32, depth=1, heads=2, out_dim=48, seed=1))
    assert not torch.equal(other.encode(request.pixel_values, grid)[0], out[0])
    first_rows = request.grid_thw[0][1] * request.grid_thw[0][2]
    alone = model.encode(request.pixel_values[:first_rows], grid[:1])
    assert torch.allclose(alone[0], out[0], atol=1e-6), "items do not see each other"


def test_the_namespace_names_the_model() -> None:
    assert SMALL.name != VisionConfig(dim=32, depth=1, heads=2, out_dim=48, seed=1).name
    assert SMALL.name != VisionConfig().name


def test_the_encoder_refuses_grids_the_merger_cannot_take() -> None:
    model = TinyVisionEncoder(SMALL)
    with pytest.raises(ValueError, match="multiples of the merge size"):
        model.encode(torch.zeros(6, SMALL.row_features), torch.tensor([[1, 2, 3]]))


def test_run_demo_encodes_each_distinct_image_once_and_matches_the_uncached_encoder() -> None:
    stream = StreamConfig(requests=8, pool=4, max_images=3)
    reports: list[EncodeReport] = []
    cache = MemoryCache(64 << 20)
    result = run_demo(cache, stream=stream, vision=SMALL, on_request=reports.append)
    distinct = {i for r in synthetic_requests(stream, SMALL) for i in r.image_ids}
    report = result.report
    assert len(reports) == 8 and sum(reports, EncodeReport()) == report
    assert report.encoded == len(distinct)
    assert report.hits + report.encoded == report.unique
    assert report.cache_errors == 0 and report.stale == 0
    assert result.max_abs_diff == 0.0
    assert result.direct_seconds is not None and result.speedup is not None
    assert result.cache_stats.entries == len(distinct)
    assert result.namespace == SMALL.name
    again = run_demo(MemoryCache(64 << 20), stream=stream, vision=SMALL, baseline=False)
    counts = (again.report.items, again.report.hits, again.report.encoded)
    assert counts == (report.items, report.hits, report.encoded), "deterministic"
    assert again.direct_seconds is None and again.max_abs_diff is None
