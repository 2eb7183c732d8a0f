"""examples/encode_server.py: run as a user runs it, and driven request by request."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from mmkey import AsyncCache, EmbeddingKey, MemoryCache
from mmkey.cli.demo import StreamConfig, TinyVisionEncoder, VisionConfig, synthetic_requests

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "encode_server.py"
sys.path.insert(0, str(EXAMPLE.parent))

import encode_server  # noqa: E402  (the example is a script, not a package)

SMALL = VisionConfig(dim=32, depth=1, heads=2, out_dim=64)


def test_the_self_test_serves_and_verifies_over_tcp() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--selftest", "6", "--clients", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "served 6 requests" in proc.stdout and "all embeddings verified" in proc.stdout


def serve(
    server: encode_server.EncodeServer,
    scenario: Callable[[str, int], Awaitable[None]],
) -> None:
    """Run `scenario(host, port)` against `server` listening on a free local port."""

    async def main() -> None:
        tcp = await asyncio.start_server(server.serve_connection, "127.0.0.1", 0)
        host, port = tcp.sockets[0].getsockname()[:2]
        async with tcp:
            await scenario(host, port)

    asyncio.run(main())


def make_server(cache: AsyncCache, config: VisionConfig = SMALL) -> encode_server.EncodeServer:
    batcher = encode_server.VisionBatcher(TinyVisionEncoder(config))
    return encode_server.EncodeServer(cache, batcher, namespace=config.name)


def test_repeats_are_served_from_the_cache_and_prefill_reads_them_by_key() -> None:
    cache = AsyncCache(MemoryCache(64 << 20))
    server = make_server(cache)
    request = next(synthetic_requests(StreamConfig(requests=1, max_images=4, seed=5), SMALL))
    doubled = (
        torch.cat([request.pixel_values, request.pixel_values]),
        request.grid_thw + request.grid_thw,
    )

    async def scenario(host: str, port: int) -> None:
        first, second = await encode_server.request_embeddings(host, port, [doubled, doubled])
        items = len(request.grid_thw)
        assert (first["hits"], first["encoded"]) == (0, items), "duplicates encoded once"
        assert (second["hits"], second["encoded"]) == (items, 0)
        assert first["keys"] == second["keys"] and first["keys"][:items] == first["keys"][items:]
        keys = [EmbeddingKey.from_key(k) for k in first["keys"]]
        assert {k.namespace for k in keys} == {SMALL.name}
        got = await encode_server.fetch_embeddings(cache, first["keys"])
        expected = server.batcher.model.encode(doubled[0], torch.tensor(doubled[1]))
        for g, e in zip(got, expected, strict=True):
            assert g is not None and torch.allclose(g, e, atol=1e-5)
        assert first["tokens"] == [int(e.shape[0]) for e in expected]

    serve(server, scenario)
    assert server.total.items == 2 * len(doubled[1])


def test_a_second_model_on_the_same_cache_encodes_everything_itself() -> None:
    cache = AsyncCache(MemoryCache(64 << 20))
    model_a = make_server(cache, SMALL)
    model_b = make_server(cache, VisionConfig(dim=32, depth=1, heads=2, out_dim=64, seed=1))
    request = next(synthetic_requests(StreamConfig(requests=1, max_images=3, seed=2), SMALL))
    payload = [(request.pixel_values, request.grid_thw)]

    async def scenario_a(host: str, port: int) -> None:
        await encode_server.request_embeddings(host, port, payload)

    async def scenario_b(host: str, port: int) -> None:
        (reply,) = await encode_server.request_embeddings(host, port, payload)
        assert reply["hits"] == 0 and reply["encoded"] == len(set(request.image_ids))

    serve(model_a, scenario_a)
    serve(model_b, scenario_b)


def test_a_bad_request_gets_an_error_naming_the_item_and_the_connection_lives_on() -> None:
    server = make_server(AsyncCache(MemoryCache(64 << 20)))
    good = next(synthetic_requests(StreamConfig(requests=1, max_images=1, seed=3), SMALL))
    bad_grid = [(1, 4, 4), (1, 4, 4)]  # 32 rows claimed

    async def scenario(host: str, port: int) -> None:
        bad = (torch.zeros(24, SMALL.row_features), bad_grid)
        replies = await encode_server.request_embeddings(
            host, port, [bad, (good.pixel_values, good.grid_thw)]
        )
        assert "item 1" in replies[0]["error"]
        assert replies[1]["encoded"] == 1 and "error" not in replies[1]

    serve(server, scenario)


def test_a_garbled_message_is_answered_then_the_connection_closes() -> None:
    server = make_server(AsyncCache(MemoryCache(1 << 20)))

    async def scenario(host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        junk = b"not json"
        writer.write(struct.pack(">I", len(junk)) + junk)
        await writer.drain()
        (length,) = struct.unpack(">I", await reader.readexactly(4))
        reply = json.loads(await reader.readexactly(length))
        assert reply["error"].startswith("bad message")
        assert await reader.read() == b"", "the server hung up"
        writer.close()
        await writer.wait_closed()

    serve(server, scenario)


def test_the_server_exports_cache_metrics_on_request() -> None:
    import re
    import urllib.request

    proc = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLE),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--dim",
            "32",
            "--depth",
            "1",
            "--heads",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline() + proc.stdout.readline()
        metrics_port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", banner)
        server_port = re.search(r"encode server on 127\.0\.0\.1:(\d+),", banner)
        assert metrics_port and server_port, banner
        config = VisionConfig(dim=32, depth=1, heads=2)
        requests = list(synthetic_requests(StreamConfig(requests=4, pool=2, seed=1), config))
        replies = asyncio.run(
            encode_server.request_embeddings(
                "127.0.0.1", int(server_port[1]), [(r.pixel_values, r.grid_thw) for r in requests]
            )
        )
        hits = sum(reply["hits"] for reply in replies)
        encoded = sum(reply["encoded"] for reply in replies)
        assert hits > 0 and encoded > 0
        url = f"http://127.0.0.1:{metrics_port[1]}/metrics"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=10) as response:
            text = response.read().decode()
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mmkey_cache_")
        }
        label = 'cache="encode_server"'
        assert values[f"mmkey_cache_hits_total{{{label}}}"] == hits
        assert values[f"mmkey_cache_inserts_total{{{label}}}"] == encoded
        assert values[f"mmkey_cache_entries{{{label}}}"] == encoded
        calls = values[f'mmkey_cache_call_seconds_count{{{label},operation="batch_is_exist"}}']
        assert calls == len(requests)
        assert values[f'mmkey_cache_call_seconds_sum{{{label},operation="batch_is_exist"}}'] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
