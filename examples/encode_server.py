"""An asyncio encode server written on mmkey, shaped like the encode workers of
disaggregated multimodal serving (an encode server in front of a prefill fleet).

A request carries one prompt's images as Qwen2-VL ``pixel_values`` and ``grid_thw``.
The server hashes each image, serves repeats from the embedding cache, runs the vision
encoder on the misses only (the misses of concurrent requests batched together, in a
worker thread), writes the new embeddings to the cache and answers with their keys.
The prefill side parses each key with ``EmbeddingKey.from_key`` and reads the embedding
from the same cache (Mooncake across machines). Keys cross the wire as text and come
back as typed keys: no bare digests, no ``str(hash)`` at call sites.

Wire format (TCP): each message is a 4-byte big-endian header length, a JSON header,
then the payload the header announces (``nbytes``; requests only).

Run::

    python examples/encode_server.py --selftest 8      # serve 8 synthetic requests, check, exit
    python examples/encode_server.py --port 8765       # serve until interrupted
    python examples/encode_server.py --store mooncake --master 127.0.0.1:50051 --selftest 8
    python examples/encode_server.py --metrics-port 9400   # also serve Prometheus /metrics
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs
import torch

from mmkey import (
    AsyncCache,
    AsyncEmbeddingCache,
    EmbeddingCache,
    EmbeddingKey,
    MemoryCache,
    TieredCache,
)
from mmkey.cli.demo import StreamConfig, TinyVisionEncoder, VisionConfig, synthetic_requests
from mmkey.encoder import EncodeReport, aencode_with_cache_report

_HEADER = struct.Struct(">I")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DESCRIPTION = "An asyncio encode server on mmkey: only cache misses reach the vision encoder."

Waiting: TypeAlias = "tuple[torch.Tensor, torch.Tensor, asyncio.Future[list[torch.Tensor]]]"
"""One request's missed items waiting for the next batch: features, grids, result."""


class BadRequest(ValueError):
    """A request the server refuses; the message goes back to the client."""


class VisionBatcher:
    """Runs the vision encoder once for the misses of all requests waiting together.

    Each request's `encode` call joins the current batch; the batch runs after
    `max_wait` seconds (or at `max_rows` patch rows) in a worker thread, off the loop.
    """

    def __init__(self, model: TinyVisionEncoder, *, max_wait: float = 0.002, max_rows: int = 1 << 16) -> None:
        self.model = model
        self.max_wait = max_wait
        self.max_rows = max_rows
        self.batches = 0
        self._waiting: list[Waiting] = []
        self._rows = 0
        self._timer: asyncio.TimerHandle | None = None

    async def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """The embeddings of these items, computed in one batch with other requests' misses."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[torch.Tensor]] = loop.create_future()
        self._waiting.append((pixel_values, grid_thw, future))
        self._rows += pixel_values.shape[0]
        if self._rows >= self.max_rows:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting, self._rows = self._waiting, [], 0
        if batch:
            asyncio.ensure_future(self._run(batch))

    async def _run(self, batch: list[Waiting]) -> None:
        self.batches += 1
        features = torch.cat([f for f, _, _ in batch])
        grids = torch.cat([g.to(torch.long) for _, g, _ in batch])
        try:
            outputs = await asyncio.to_thread(self.model.encode, features, grids)
        except Exception as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        start = 0
        for _, g, future in batch:
            count = int(g.shape[0])
            if not future.done():
                future.set_result(outputs[start : start + count])
            start += count


@attrs.frozen
class EncodeResponse:
    """The keys of a request's embeddings and their token counts (in item order)."""

    keys: list[EmbeddingKey]
    tokens: list[int]
    report: EncodeReport


class EncodeServer:
    """Encodes requests through the embedding cache; only misses reach the model."""

    def __init__(self, cache: AsyncEmbeddingCache, batcher: VisionBatcher, *, namespace: str) -> None:
        self.cache = cache
        self.batcher = batcher
        self.namespace = namespace
        self.total = EncodeReport()

    async def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> EncodeResponse:
        """Embed one request's images; the embeddings end up in the cache under the keys."""
        result = await aencode_with_cache_report(
            pixel_values,
            grid_thw,
            encode=self.batcher.encode,
            cache=self.cache,
            namespace=self.namespace,
        )
        self.total += result.report
        tokens = [int(e.shape[0]) for e in result.embeddings]
        return EncodeResponse(result.keys, tokens, result.report)

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the requests of one connection, in order, until the client closes it."""
        try:
            while True:
                try:
                    header, payload = await read_message(reader)
                except asyncio.IncompleteReadError:
                    return
                except (BadRequest, ValueError) as exc:  # the framing is lost: answer, hang up
                    write_message(writer, {"id": None, "error": f"bad message: {exc}"})
                    await writer.drain()
                    return
                reply: dict[str, Any] = {"id": header.get("id")}
                try:
                    pixel_values, grid_thw = decode_request(header, payload)
                    response = await self.encode(pixel_values, grid_thw)
                except (TypeError, ValueError) as exc:  # BadRequest, or a rows/grid mismatch
                    reply["error"] = str(exc)
                else:
                    reply["keys"] = [k.to_key() for k in response.keys]
                    reply["tokens"] = response.tokens
                    reply["hits"] = response.report.hits
                    reply["encoded"] = response.report.encoded
                write_message(writer, reply)
                await writer.drain()
        finally:
            writer.close()


async def read_message(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """One framed message: its JSON header and its payload (``header['nbytes']`` bytes)."""
    (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if length > _MAX_HEADER:
        raise BadRequest(f"header of {length} bytes is too large")
    header = json.loads(await reader.readexactly(length))
    if not isinstance(header, dict):
        raise BadRequest("the header must be a JSON object")
    nbytes = header.get("nbytes", 0)
    if not isinstance(nbytes, int) or not 0 <= nbytes <= _MAX_PAYLOAD:
        raise BadRequest(f"nbytes must be an int in 0..{_MAX_PAYLOAD}")
    payload = await reader.readexactly(nbytes) if nbytes else b""
    return header, payload


def write_message(writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes = b"") -> None:
    """Frame and queue one message."""
    text = json.dumps(dict(header, nbytes=len(payload))).encode()
    writer.write(_HEADER.pack(len(text)) + text + payload)


def encode_request(
    request_id: str, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]]
) -> tuple[dict[str, Any], bytes]:
    """The header and payload of a request (the client side)."""
    header = {
        "id": request_id,
        "dtype": str(pixel_values.dtype).removeprefix("torch."),
        "shape": list(pixel_values.shape),
        "grid_thw": [list(g) for g in grids],
    }
    return header, pixel_values.contiguous().view(torch.uint8).numpy().tobytes()


def decode_request(header: dict[str, Any], payload: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``pixel_values`` and ``grid_thw`` of a request; `BadRequest` if malformed."""
    dtype = _DTYPES.get(str(header.get("dtype")))
    if dtype is None:
        raise BadRequest(f"dtype must be one of {sorted(_DTYPES)}")
    shape = header.get("shape")
    if not (
        isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n >= 0 for n in shape)
    ):
        raise BadRequest("shape must be [rows, features]")
    needed = shape[0] * shape[1] * dtype.itemsize
    if needed != len(payload):
        raise BadRequest(f"payload has {len(payload)} bytes, shape {shape} needs {needed}")
    grids = header.get("grid_thw")
    if not isinstance(grids, list):
        raise BadRequest("grid_thw must be a list of [t, h, w]")
    if payload:
        pixel_values = torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape)
    else:
        pixel_values = torch.zeros(shape, dtype=dtype)
    return pixel_values, torch.tensor(grids, dtype=torch.long).reshape(-1, 3)


async def request_embeddings(
    host: str, port: int, requests: Sequence[tuple[torch.Tensor, Sequence[Sequence[int]]]]
) -> list[dict[str, Any]]:
    """Send requests over one connection (as a prefill worker does); the replies."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        replies = []
        for i, (pixel_values, grids) in enumerate(requests):
            write_message(writer, *encode_request(str(i), pixel_values, grids))
            await writer.drain()
            replies.append((await read_message(reader))[0])
        return replies
    finally:
        writer.close()
        await writer.wait_closed()


async def fetch_embeddings(cache: AsyncEmbeddingCache, key_texts: Sequence[str]) -> list[torch.Tensor | None]:
    """The prefill side: parse the keys the encode server sent and read their embeddings."""
    keys = [EmbeddingKey.from_key(text) for text in key_texts]
    return await cache.get_embeddings(keys)


def make_cache(store: str, master: str | None, l1_bytes: int = 256 << 20) -> EmbeddingCache:
    """The embedded MemoryCache, or an in-process L1 over a Mooncake L2 (as the stacks do)."""
    if store == "memory":
        return MemoryCache(l1_bytes)
    from mmkey import MooncakeCache, MooncakeConfig

    if master is None:
        config = MooncakeConfig.from_env()
    else:
        config = MooncakeConfig.from_env(master_server_address=master)
    return TieredCache(MemoryCache(l1_bytes), MooncakeCache(config))


async def selftest(server: EncodeServer, count: int, clients: int, seed: int) -> int:
    """Serve `count` synthetic requests from `clients` concurrent clients over TCP and
    check every embedding the prefill side reads against the model run directly."""
    model = server.batcher.model
    stream = StreamConfig(requests=count, pool=max(4, count), seed=seed)
    requests = list(synthetic_requests(stream, model.config))
    shares = [requests[c::clients] for c in range(clients)]
    tcp = await asyncio.start_server(server.serve_connection, "127.0.0.1", 0)
    host, port = tcp.sockets[0].getsockname()[:2]
    async with tcp:
        replies = await asyncio.gather(
            *(
                request_embeddings(host, port, [(r.pixel_values, r.grid_thw) for r in share])
                for share in shares
            )
        )
    wrong = 0
    for share, share_replies in zip(shares, replies, strict=True):
        for request, reply in zip(share, share_replies, strict=True):
            if "error" in reply:
                print(f"request {request.index}: error: {reply['error']}", file=sys.stderr)
                wrong += 1
                continue
            got = await fetch_embeddings(server.cache, reply["keys"])
            expected = model.encode(request.pixel_values, torch.tensor(request.grid_thw))
            for g, e in zip(got, expected, strict=True):
                wrong += g is None or not torch.allclose(g, e, atol=1e-5)
    total = server.total
    print(
        f"served {count} requests ({total.items} images) to {clients} clients: "
        f"{total.hits} cache hits, {total.encoded} images encoded in "
        f"{server.batcher.batches} batches, {total.cache_errors} cache errors; "
        + ("all embeddings verified" if wrong == 0 else f"{wrong} WRONG")
    )
    return 0 if wrong == 0 else 1


def serve_metrics(cache: EmbeddingCache, host: str, port: int) -> tuple[EmbeddingCache, Any]:
    """Wrap `cache` in a `MeteredCache` and serve Prometheus ``/metrics`` on ``host:port``
    (0 picks a free port); the metered cache and the HTTP server (``shutdown()`` it)."""
    from prometheus_client import start_http_server

    from mmkey.metrics import MeteredCache

    metered = MeteredCache(cache, name="encode_server")
    http, _ = start_http_server(port, addr=host)
    print(f"metrics on http://{host}:{http.server_port}/metrics", flush=True)
    return metered, http


async def run(args: argparse.Namespace) -> int:
    """Build the server and serve (or run the self-test)."""
    vision = VisionConfig(dim=args.dim, depth=args.depth, heads=args.heads, seed=args.seed)
    inner = make_cache(args.store, args.master)
    metrics_http = None
    if args.metrics_port is not None:
        inner, metrics_http = serve_metrics(inner, args.host, args.metrics_port)
    cache = AsyncCache(inner)
    batcher = VisionBatcher(TinyVisionEncoder(vision))
    server = EncodeServer(cache, batcher, namespace=vision.name)
    try:
        if args.selftest:
            return await selftest(server, args.selftest, args.clients, args.seed)
        tcp = await asyncio.start_server(server.serve_connection, args.host, args.port)
        port = tcp.sockets[0].getsockname()[1]
        print(f"encode server on {args.host}:{port}, namespace {vision.name}", flush=True)
        async with tcp:
            await tcp.serve_forever()
        return 0
    finally:
        await cache.close()
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--store", choices=["memory", "mooncake"], default="memory")
    parser.add_argument("--master", help="Mooncake master host:port (default: MOONCAKE_MASTER)")
    parser.add_argument(
        "--selftest", type=int, default=0, metavar="N", help="serve N synthetic requests, exit"
    )
    parser.add_argument("--clients", type=int, default=3, help="concurrent self-test clients")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics of the cache on this port (0: any free port)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=64, help="width of the vision encoder")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
