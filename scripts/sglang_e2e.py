"""SGLang's real encode servers serving embeddings through mmkey's store, on CPU or on a GPU.

One script for both devices (``--device cpu`` on any machine, ``--device cuda`` on an NVIDIA
GPU): ``tests/integrations/sglang/test_sglang_engine.py`` runs it on CPU in ``make test``, and
``scripts/gpu-check.sh`` runs it on a GPU. Run in SGLang's environment (``.venv-sglang``).

It builds a tiny random-weight Qwen2-VL (a locally trained tokenizer, nothing downloaded),
starts a real ``mooncake_master`` and one segment holder, then four encoder-only SGLang
servers (``--encoder-only --encoder-transfer-backend zmq_to_tokenizer``):

- ``a`` and ``b``: ``--enable-mm-global-cache --mm-global-cache-backend mooncake`` with
  ``MMKEY_SGLANG_BACKEND=1``, one namespace and one fleet entry secret
  (``MMKEY_ENTRY_AUTH=required``);
- ``c``: the same, in another namespace, with ``MMKEY_SGLANG_HASH=blake3``;
- ``ref``: no global cache: the embedding SGLang computes without any store.

Each ``/encode`` names a ZMQ receiver of this script's own, standing in for the prefill side
(``zmq_to_tokenizer``); the bytes it receives are the embedding the server served. Then the
scenarios run, each on evidence: the servers' hit and miss log lines, the master's keys
(``/get_all_keys``), the received bytes against ``ref``'s, both servers healthy afterwards
and no traceback in any log. Prints one JSON line (the evidence of every scenario and
``ok``); exit status 0 only when every scenario held. ``--setup-only`` builds the model and
checks that SGLang, the binding and a master start, without starting servers.

On CPU: ``SGLANG_USE_CPU_ENGINE=1 --device cpu --mm-attention-backend sdpa``, SGLang patched
with ``patches/sglang-0.5.23-cpu-global-cache.patch`` (``scripts/sglang-env.sh`` applies it),
and, where ``sgl_kernel`` does not import, the import stand-in of
``scripts/sgl_kernel_standin.py`` (no kernel of it is ever called on these paths).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

NAMESPACE = "tiny-qwen2-vl@e2e"
OTHER_NAMESPACE = "tiny-qwen2-vl@e2e-blake3"
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
START_TIMEOUT = 420.0
"""Seconds for the servers to become healthy (four start side by side on two cores)."""
REQUEST_TIMEOUT = 120.0
STORED_TIMEOUT = 30.0
"""Seconds for an entry to appear in the master after its ``/encode`` returned (SGLang puts
it from a background task)."""
DEAD_MASTER_BOUND = 30.0
"""Seconds within which a server answers, by encoding, once the master is dead (mmkey's
calls give up after MOONCAKE timeout, 2 s here)."""
MOONCAKE_TIMEOUT = "2.0"
SERVERS = ("a", "b", "c", "ref")

#: server options that keep SGLang off sgl_kernel where it offers a switch
KERNEL_FREE_ARGS = ("--mm-attention-backend", "sdpa")
WAITED = re.compile(
    r"mmkey SGLang store: waited [0-9.]+ s for (\d+) item\(s\) another encoder claimed: "
    r"(\d+) served, (\d+) encoded here"
)
CACHE_CHECK = re.compile(
    r"Multi-Level Cache Check === Total: (\d+) \| Local Hits: (\d+) \| Global Hits: (\d+) "
    r"\| Misses \(GPU Work\): (\d+)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(
    root: Path,
    *,
    vision: dict[str, int] | None = None,
    hidden: int = 128,
    max_pixels: int = 224 * 224,
    name: str = "tiny-qwen2-vl",
) -> Path:
    """A random-weight Qwen2-VL of a few million parameters, saved with its processor under
    ``root / name``. ``vision`` overrides the vision tower's sizes (``depth``, ``embed_dim``,
    ``num_heads``, ``mlp_ratio``), ``hidden`` is the width of the decoder and so of the
    embeddings the tower hands over, ``max_pixels`` the most the processor keeps of an image
    (the serving benchmark builds a larger tower with these; the defaults are this script's)."""
    import torch

    tok: Any = importlib.import_module("tokenizers")  # SGLang's environment has these; mmkey's not
    hf: Any = importlib.import_module("transformers")
    Tokenizer, models, pre_tokenizers, trainers = tok.Tokenizer, tok.models, tok.pre_tokenizers, tok.trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["Describe this image.", "user assistant system", "a picture of a cat"], trainer)
    tokenizer = hf.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
        "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    config = hf.Qwen2VLConfig(
        text_config={
            "hidden_size": hidden,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
            "torch_dtype": "bfloat16",
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        # SGLang's Qwen2-VL reads ``in_chans``; transformers 5 names it ``in_channels``
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            **(vision or {}),
            "hidden_size": hidden,
            "in_channels": 3,
            "in_chans": 3,
        },  # fmt: skip
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = hf.Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    path = root / name
    model.save_pretrained(path)
    processor = hf.Qwen2VLProcessor(
        image_processor=hf.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=max_pixels),
        video_processor=hf.Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    if written.get("vision_config", {}).get("in_chans") != 3:  # a transformers that drops it
        written.setdefault("vision_config", {})["in_chans"] = 3
        (path / "config.json").write_text(json.dumps(written, indent=2))
    return path


def image(root: Path, seed: int, size: int = 112) -> str:
    """A deterministic ``size`` x ``size`` RGB picture, different for every seed."""
    image_module: Any = importlib.import_module("PIL.Image")

    path = root / (f"image-{seed}.png" if size == 112 else f"image-{seed}-{size}.png")
    a, b = 7 + 2 * seed, 13 + 5 * seed
    pixels = bytes((x * a + y * b + 31 * seed) % 256 for y in range(size) for x in range(size * 3))
    written = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    image_module.frombytes("RGB", (size, size), pixels).save(written, format="PNG")
    os.replace(written, path)  # a server reading the path never sees a half-written file
    return str(path)


def sgl_kernel_kind() -> str:
    """``real VERSION``, ``stand-in`` or ``absent``: as scripts/gpu-check.sh found it, else
    whether ``sgl_kernel`` is installed at all (``absent``: this script writes the stand-in)."""
    known = os.environ.get("MMKEY_GPU_CHECK_SGL_KERNEL")
    if known:
        return known
    if importlib.util.find_spec("sgl_kernel") is None:
        return "absent"
    code = (
        "import importlib.metadata as m, sgl_kernel\n"
        "if hasattr(sgl_kernel, '__sgl_kernel_standin__'): print('stand-in')\n"
        "else:\n"
        "    try: print('real', m.version('sglang-kernel'))\n"
        "    except m.PackageNotFoundError: print('real (of unknown version)')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else "absent"


def write_stand_in(root: Path, reason: str) -> Path:
    """The ``sgl_kernel`` stand-in package under ``root``; returns the folder to put on the path."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    try:
        standin: Any = importlib.import_module("sgl_kernel_standin")
    finally:
        sys.path.remove(str(here))
    folder = root / "standin"
    standin.write(folder, reason)
    return folder


class Server:
    """One encode server process: its port, its log, and what it logged since a mark."""

    def __init__(self, name: str, port: int, log: Path, process: subprocess.Popen[bytes]) -> None:
        self.name, self.port, self.log, self.process = name, port, log, process

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def mark(self) -> int:
        return self.log.stat().st_size

    def since(self, mark: int) -> str:
        with self.log.open("rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=60) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_server(
    name: str,
    model: Path,
    env: dict[str, str],
    root: Path,
    extra: Sequence[str],
    global_cache: bool,
    launcher: Sequence[str] = ("-m", "sglang.launch_server"),
) -> Server:
    """One encode server; ``launcher`` is what follows the interpreter on its command line
    before SGLang's options (SGLang's own launcher, or a script that wraps it)."""
    port = free_port()
    cache = ("--enable-mm-global-cache", "--mm-global-cache-backend", "mooncake") if global_cache else ()
    command = [
        sys.executable, *launcher, "--model-path", str(model), "--encoder-only",
        *cache, "--encoder-transfer-backend", "zmq_to_tokenizer", "--host", "127.0.0.1",
        "--port", str(port), "--mem-fraction-static", "0.1", "--trust-remote-code", *extra,
    ]  # fmt: skip
    log = root / f"server-{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(name, port, log, process)


def wait_healthy(servers: Sequence[Server]) -> None:
    give_up = time.monotonic() + START_TIMEOUT
    waiting = list(servers)
    while waiting and time.monotonic() < give_up:
        for server in list(waiting):
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"server {server.name} exited {server.process.returncode}: {server.text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=60) as reply:
                    if reply.status == 200:
                        waiting.remove(server)
            except OSError:
                pass
        time.sleep(1)
    if waiting:
        names = ", ".join(s.name for s in waiting)
        raise RuntimeError(f"not healthy within {START_TIMEOUT:.0f} s: {names}: {waiting[0].text()[-3000:]}")


class Encoded:
    """What one ``/encode`` gave: the HTTP status, the bytes the receiver got, how long."""

    def __init__(self, status: int, payload: bytes, seconds: float, error: str = "") -> None:
        self.status, self.payload, self.seconds, self.error = status, payload, seconds, error

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()[:16] if self.payload else ""


def encode(
    server: Server, req_id: str, paths: Sequence[str], hashes: Sequence[object] | None = None
) -> Encoded:
    """POST /encode to ``server``, then the embedding it pushes to a receiver made for this
    request (the prefill side's part in SGLang's disaggregated flow)."""
    zmq: Any = importlib.import_module("zmq")
    context = zmq.Context.instance()
    receiver = context.socket(zmq.PULL)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    body: dict[str, Any] = {
        "req_id": req_id, "modality": "image", "mm_items": list(paths), "num_parts": 1, "part_idx": 0,
        "prefill_host": "127.0.0.1", "embedding_port": port,
    }  # fmt: skip
    if hashes is not None:
        body["hashes"] = list(hashes)
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/encode",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    start = time.monotonic()
    try:
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
                status = int(reply.status)
        except urllib.error.HTTPError as exc:
            return Encoded(exc.code, b"", time.monotonic() - start, exc.read()[:500].decode(errors="replace"))
        if not receiver.poll(int(REQUEST_TIMEOUT * 1000)):
            return Encoded(status, b"", time.monotonic() - start, "no embedding reached the receiver")
        frames = receiver.recv_multipart()
        seconds = time.monotonic() - start
        if len(frames) < 2:
            return Encoded(status, b"", seconds, f"no embedding bytes: {frames[0][:300]!r}")
        return Encoded(status, bytes(frames[-1]), seconds)
    finally:
        receiver.close(linger=0)


def cache_checks(text: str) -> dict[str, int]:
    """The sums of SGLang's ``Multi-Level Cache Check`` lines in ``text``."""
    total = {"lines": 0, "total": 0, "local_hits": 0, "global_hits": 0, "misses": 0}
    for found in CACHE_CHECK.finditer(text):
        total["lines"] += 1
        for name, value in zip(("total", "local_hits", "global_hits", "misses"), found.groups(), strict=True):
            total[name] += int(value)
    return total


class Run:
    """The fleet of one run: master, holder, servers, the reference bytes, the store's keys."""

    def __init__(
        self, root: Path, fleet: Any, servers: dict[str, Server], images: Callable[[int], str]
    ) -> None:
        self.root, self.fleet, self.servers, self.images = root, fleet, servers, images
        self._reference: dict[tuple[int, ...], Encoded] = {}

    def keys(self) -> list[str]:
        from mmkey.cache.mooncake import _master_http

        master = self.fleet.master
        body = _master_http.get(master.host, master.metrics_port, "/get_all_keys", timeout=5, limit=64 << 20)
        if body is None:
            raise RuntimeError("the master did not list its keys")
        return sorted(line.strip() for line in body.decode().splitlines() if line.strip())

    def keys_of(self, namespace: str) -> list[str]:
        return [k for k in self.keys() if k.startswith(f"mmk1@{_quoted(namespace)}@")]

    def wait_new_key(self, namespace: str, before: Sequence[str]) -> list[str]:
        """The keys of ``namespace`` that appeared since ``before``, once at least one did."""
        give_up = time.monotonic() + STORED_TIMEOUT
        while True:
            new = sorted(set(self.keys_of(namespace)) - set(before))
            if new or time.monotonic() > give_up:
                return new
            time.sleep(0.1)

    def reference(self, *seeds: int) -> Encoded:
        """``ref``'s embedding of these images, in this order, as one request."""
        if seeds not in self._reference:
            self._reference[seeds] = encode(
                self.servers["ref"], f"ref-{'-'.join(map(str, seeds))}", [self.images(s) for s in seeds]
            )
        return self._reference[seeds]

    def raw_client(self) -> contextlib.AbstractContextManager[Any]:
        return _raw_client(self.fleet.master.address)


@contextlib.contextmanager
def _raw_client(master: str) -> Iterator[Any]:
    """A client on the raw binding that lends nothing: what it writes lands in the holder."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
        raise RuntimeError("a raw client could not join the master")
    try:
        yield client
    finally:
        client.close()


def _quoted(namespace: str) -> str:
    from mmkey.digest import HashScheme, MMHash, Modality
    from mmkey.keys import EmbeddingKey

    text = EmbeddingKey(namespace, Modality.IMAGE, HashScheme.ID, MMHash(1)).to_key()
    return text.split("@")[1]


def _replace(client: Any, key: str, data: bytes) -> None:
    """Put ``data`` under ``key`` in place of what is there (a read's lease holds an entry
    for a few seconds, so the removal is retried within a bound)."""
    give_up = time.monotonic() + 30
    while client.remove(key) != 0:
        if time.monotonic() > give_up:
            raise RuntimeError(f"could not remove {key}")
        time.sleep(0.2)
    if client.put(key, data) != 0:
        raise RuntimeError(f"could not put {key}")


def _both_healthy(run: Run, *names: str) -> dict[str, bool]:
    return {name: run.servers[name].healthy() for name in names}


def scenario_hit(run: Run) -> dict[str, Any]:
    """Server a encodes an image and stores it; server b serves the same image from the store."""
    a, b = run.servers["a"], run.servers["b"]
    before = run.keys_of(NAMESPACE)
    mark_a, mark_b = a.mark(), b.mark()
    first = encode(a, "hit-a", [run.images(1)])
    new = run.wait_new_key(NAMESPACE, before)
    second = encode(b, "hit-b", [run.images(1)])
    ref = run.reference(1)
    text_a, text_b = a.since(mark_a), b.since(mark_b)
    return {
        "a": cache_checks(text_a), "b": cache_checks(text_b), "new_keys": new,
        "a_stored": text_a.count("Stored 1/1"), "b_fetched": text_b.count("Successfully fetched 1/1"),
        "digests": {"a": first.digest, "b": second.digest, "ref": ref.digest},
        "bytes": len(second.payload), "errors": [e.error for e in (first, second, ref) if e.error],
        "healthy": _both_healthy(run, "a", "b"),
    }  # fmt: skip


def scenario_damaged(run: Run) -> dict[str, Any]:
    """A stored entry's payload is damaged in the store: b recomputes and stays up."""
    a, b = run.servers["a"], run.servers["b"]
    before = run.keys_of(NAMESPACE)
    encode(a, "damaged-a", [run.images(2)])
    new = run.wait_new_key(NAMESPACE, before)
    with run.raw_client() as client:
        data = bytearray(client.get(new[0]))
        data[-3] ^= 0x01
        _replace(client, new[0], bytes(data))
    mark_b = b.mark()
    served = encode(b, "damaged-b", [run.images(2)])
    text_b = b.since(mark_b)
    return {
        "new_keys": new, "b": cache_checks(text_b), "b_fetched": text_b.count("Successfully fetched 1/1"),
        "refusals_logged": _refusal_lines(text_b), "fallbacks": text_b.count("falling back to ViT"),
        "digests": {"b": served.digest, "ref": run.reference(2).digest},
        "errors": [served.error] if served.error else [], "healthy": _both_healthy(run, "a", "b"),
    }  # fmt: skip


def _refusal_lines(text: str) -> list[str]:
    """mmkey's log lines of entries it refused to serve."""
    return [line[-300:] for line in text.splitlines() if "did not verify, served as misses" in line]


def scenario_forged(run: Run) -> dict[str, Any]:
    """A writer without the fleet secret puts a well-formed entry (another image's embedding)
    under an image's key: under MMKEY_ENTRY_AUTH=required b never serves it."""
    import torch

    from mmkey.entry.codec import encode_entry

    a, b = run.servers["a"], run.servers["b"]
    before = run.keys_of(NAMESPACE)
    honest = encode(a, "forged-a", [run.images(3)])
    new = run.wait_new_key(NAMESPACE, before)
    other = run.reference(4)
    with run.raw_client() as client:
        wrong = torch.frombuffer(bytearray(other.payload), dtype=torch.bfloat16).reshape(-1, 128)
        forged = encode_entry(new[0], wrong)  # unsigned: no keyring
        _replace(client, new[0], forged)
    mark_b = b.mark()
    served = encode(b, "forged-b", [run.images(3)])
    text_b = b.since(mark_b)
    return {
        "new_keys": new, "b": cache_checks(text_b), "refusals_logged": _refusal_lines(text_b),
        "fallbacks": text_b.count("falling back to ViT"),
        "digests": {
            "a": honest.digest, "b": served.digest, "ref": run.reference(3).digest, "forged": other.digest,
        },
        "errors": [served.error] if served.error else [], "healthy": _both_healthy(run, "a", "b"),
    }  # fmt: skip


def scenario_namespace(run: Run) -> dict[str, Any]:
    """Server c (another namespace, BLAKE3-128 hashes) sees nothing of a's entries, and stores
    its own under a 128-bit BLAKE3 key that an mmkey reader of its namespace verifies."""
    import torch

    from mmkey.cache.mooncake import MooncakeCache, MooncakeConfig
    from mmkey.digest import HashScheme
    from mmkey.keys import EmbeddingKey

    c = run.servers["c"]
    before = run.keys_of(OTHER_NAMESPACE)
    mark = c.mark()
    served = encode(c, "namespace-c", [run.images(1)])  # a stored image 1 in its namespace
    new = run.wait_new_key(OTHER_NAMESPACE, before)
    text = c.since(mark)
    parsed = [EmbeddingKey.from_key(k) for k in new]
    read_back = ""
    if new:
        config = MooncakeConfig(
            master_server_address=run.fleet.master.address, global_segment_size=0,
            local_buffer_size=16 << 20, protocol="tcp", local_hostname="127.0.0.1",
        )  # fmt: skip
        with MooncakeCache(config, keyring=_keyring(run)) as cache:
            tensor = cache.get_embeddings([parsed[0]])[0]
            if tensor is not None:
                raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                read_back = hashlib.sha256(raw).hexdigest()[:16]
    return {
        "c": cache_checks(text), "new_keys": new,
        "schemes": [k.scheme.value for k in parsed],
        "digest_bits": [int(k.digest).bit_length() for k in parsed],
        "blake3": [k.scheme is HashScheme.BLAKE3 for k in parsed],
        "digests": {"c": served.digest, "ref": run.reference(1).digest, "read_back": read_back},
        "errors": [served.error] if served.error else [], "healthy": _both_healthy(run, "c"),
    }  # fmt: skip


def _keyring(run: Run) -> Any:
    from mmkey.entry.auth import EntryKeyring, EntrySecret

    secret = (run.root / "entry.key").read_text().strip()
    return EntryKeyring(EntrySecret.from_secret(secret))


def single_flight_waits(text: str) -> dict[str, int]:
    """The sums of mmkey's ``waited ... for N item(s) another encoder claimed: S served, E
    encoded here`` lines in ``text``."""
    total = {"lines": 0, "items": 0, "served": 0, "encoded": 0}
    for found in WAITED.finditer(text):
        total["lines"] += 1
        for name, value in zip(("items", "served", "encoded"), found.groups(), strict=True):
            total[name] += int(value)
    return total


def scenario_concurrent_and_batch(run: Run) -> dict[str, Any]:
    """One new image asked of a and b at the same moment (single-flight: one of them encodes
    it, the other waits for its entry and serves it from the store); then one request of three
    images to b, two of them stored by a and one never seen."""
    a, b = run.servers["a"], run.servers["b"]
    before = run.keys_of(NAMESPACE)
    mark_a, mark_b = a.mark(), b.mark()
    results: dict[str, Encoded] = {}
    barrier = threading.Barrier(2)
    picture = run.images(5)  # written once, before either asks

    def ask(server: Server) -> None:
        barrier.wait()
        results[server.name] = encode(server, f"same-{server.name}", [picture])

    threads = [threading.Thread(target=ask, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same_keys = run.wait_new_key(NAMESPACE, before)
    text_a, text_b = a.since(mark_a), b.since(mark_b)
    concurrent = {
        "a": cache_checks(text_a), "b": cache_checks(text_b), "new_keys": same_keys,
        "waits": {"a": single_flight_waits(text_a), "b": single_flight_waits(text_b)},
        "fetched": text_a.count("Successfully fetched 1/1") + text_b.count("Successfully fetched 1/1"),
        "digests": {"a": results["a"].digest, "b": results["b"].digest, "ref": run.reference(5).digest},
    }  # fmt: skip
    before = run.keys_of(NAMESPACE)
    for seed in (6, 7):
        encode(a, f"batch-a-{seed}", [run.images(seed)])
    stored = run.wait_new_key(NAMESPACE, before)
    give_up = time.monotonic() + STORED_TIMEOUT
    while len(stored) < 2 and time.monotonic() < give_up:
        time.sleep(0.1)
        stored = sorted(set(run.keys_of(NAMESPACE)) - set(before))
    mark_b = b.mark()
    batch = encode(b, "batch-b", [run.images(6), run.images(8), run.images(7)])
    batch_text = b.since(mark_b)
    return {
        "concurrent": concurrent, "batch_stored_first": stored, "batch": cache_checks(batch_text),
        "batch_digests": {"b": batch.digest, "ref": run.reference(6, 8, 7).digest},
        "errors": [e.error for e in (*results.values(), batch) if e.error],
        "healthy": _both_healthy(run, "a", "b"),
    }  # fmt: skip


def scenario_caller_hashes(run: Run) -> dict[str, Any]:
    """A client sends image 9's pixels to a under the hash SGLang computes for image 10, before
    anyone asked for image 10; an honest request for image 10 on b must get image 10's
    embedding. The hash is SGLang's own, learnt from c (another namespace: a's and b's
    namespace never saw image 10)."""
    from mmkey.keys import EmbeddingKey

    a, b = run.servers["a"], run.servers["b"]
    # no server of a's namespace may see image 10 first, so its hash is computed here as the
    # server computes it, and the method checked against the key a stored for image 1
    hash_10, hash_1 = sglang_hash(run, 10), sglang_hash(run, 1)
    known = [EmbeddingKey.from_key(k) for k in run.keys_of(NAMESPACE)]
    hash_checked = any(k.scheme.value == "sglang" and int(k.digest) == hash_1 for k in known)
    before = run.keys_of(NAMESPACE)
    mark_a = a.mark()
    poisoned = encode(a, "caller-hash-a", [run.images(9)], hashes=[str(hash_10)])
    new = run.wait_new_key(NAMESPACE, before)
    text_a = a.since(mark_a)
    mark_b = b.mark()
    before_b = run.keys_of(NAMESPACE)
    honest = encode(b, "caller-hash-b", [run.images(10)])
    run.wait_new_key(NAMESPACE, before_b)  # b's put lands here, not in the next scenario's count
    text_b = b.since(mark_b)
    return {
        "hash_method_checked": hash_checked, "a": cache_checks(text_a), "b": cache_checks(text_b),
        "caller_keys": new, "caller_schemes": [EmbeddingKey.from_key(k).scheme.value for k in new],
        "digests": {
            "b": honest.digest, "ref": run.reference(10).digest, "sent": poisoned.digest,
            "ref_sent": run.reference(9).digest,
        },
        "errors": [e.error for e in (poisoned, honest) if e.error], "healthy": _both_healthy(run, "a", "b"),
    }  # fmt: skip


def sglang_hash(run: Run, seed: int) -> int:
    """SGLang's CPU hash of image ``seed``'s features as the encode server computes it: the
    model's own processor, then SGLang's ``hash_feature``."""
    hf: Any = importlib.import_module("transformers")
    image_module: Any = importlib.import_module("PIL.Image")
    from sglang.srt.multimodal.modality import Modality

    MultimodalDataItem = importlib.import_module("sglang.srt.managers.schedule_batch").MultimodalDataItem

    processor = hf.AutoProcessor.from_pretrained(str(run.root / "tiny-qwen2-vl"))
    picture = image_module.open(run.images(seed)).convert("RGB")
    features = processor.image_processor(images=[picture], return_tensors="pt")["pixel_values"]
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=features)
    item.set_pad_value()
    return int(item.hash)


def scenario_dead_master(run: Run) -> dict[str, Any]:
    """The master is killed after a stored an image: b answers within a bound by encoding."""
    a, b = run.servers["a"], run.servers["b"]
    before = run.keys_of(NAMESPACE)
    encode(a, "dead-a", [run.images(11)])
    new = run.wait_new_key(NAMESPACE, before)
    run.fleet.master.kill()
    mark_b = b.mark()
    served = encode(b, "dead-b", [run.images(11)])
    text_b = b.since(mark_b)
    return {
        "new_keys": new, "b": cache_checks(text_b), "seconds": round(served.seconds, 2),
        "bound": DEAD_MASTER_BOUND, "digests": {"b": served.digest, "ref": run.reference(11).digest},
        "errors": [served.error] if served.error else [], "healthy": _both_healthy(run, "a", "b"),
    }  # fmt: skip


SCENARIOS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "hit": scenario_hit,
    "damaged": scenario_damaged,
    "forged": scenario_forged,
    "namespace": scenario_namespace,
    "concurrent_and_batch": scenario_concurrent_and_batch,
    "caller_hashes": scenario_caller_hashes,
    "dead_master": scenario_dead_master,  # last: the master stays dead
}


def held(name: str, seen: dict[str, Any]) -> bool:
    """Whether scenario ``name``'s evidence shows what it must."""
    d = seen.get("digests", {})
    fine = not seen.get("errors") and all(seen.get("healthy", {}).values())
    if name == "hit":
        return (
            fine
            and d["a"] == d["b"] == d["ref"] != ""
            and seen["b"]["global_hits"] == 1
            and seen["b"]["misses"] == 0
            and len(seen["new_keys"]) == 1
        )
    if name == "damaged":
        return fine and d["b"] == d["ref"] != "" and seen["fallbacks"] == 1
    if name == "forged":
        return fine and d["b"] == d["ref"] != "" and d["b"] != d["forged"] and seen["fallbacks"] == 1
    if name == "namespace":
        return (
            fine
            and d["c"] == d["ref"] == d["read_back"] != ""
            and seen["c"]["global_hits"] == 0
            and seen["blake3"] == [True]
            and seen["digest_bits"][0] > 64
        )
    if name == "concurrent_and_batch":
        both = seen["concurrent"]
        cd, bd = both["digests"], seen["batch_digests"]
        waits = [both["waits"][s] for s in ("a", "b")]
        return (
            fine
            and cd["a"] == cd["b"] == cd["ref"] != ""
            and len(both["new_keys"]) == 1
            and both["a"]["misses"] + both["b"]["misses"] == 1  # one encode for the two servers
            and both["a"]["global_hits"] + both["b"]["global_hits"] == 1
            # the other waited and was served, or looked once the entry had landed: never encoded
            and sorted(w["served"] for w in waits) in ([0, 0], [0, 1])
            and all(w["encoded"] == 0 for w in waits)
            and both["fetched"] == 1
            and bd["b"] == bd["ref"] != ""
            and seen["batch"]["global_hits"] == 2
            and seen["batch"]["misses"] == 1
        )
    if name == "caller_hashes":
        return (
            fine
            and d["b"] == d["ref"] != ""
            and d["sent"] == d["ref_sent"]
            and all(s == "id" for s in seen["caller_schemes"])
        )
    if name == "dead_master":
        return fine and d["b"] == d["ref"] != "" and seen["seconds"] < seen["bound"]
    return False


def prepare(root: Path, kernel: str, **model: Any) -> tuple[Path | None, Path]:
    """What every server of a run shares, under ``root``: the ``sgl_kernel`` stand-in where
    ``kernel`` is ``absent`` (its folder, else ``None``), the fleet's entry secret file
    (``entry.key``, 0600) and the tiny model (its folder; ``model``: `build_model`'s sizes)."""
    stand_in = write_stand_in(root, "sglang-kernel is not installed here") if kernel == "absent" else None
    secret = root / "entry.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    return stand_in, build_model(root, **model)


def server_env(root: Path, master: str, device: str, stand_in: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MMKEY_SGLANG_BACKEND="1", MOONCAKE_MASTER=master, MOONCAKE_PROTOCOL="tcp",
        MOONCAKE_GLOBAL_SEGMENT_SIZE="0", MOONCAKE_LOCAL_BUFFER_SIZE="32MB",
        MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
        MOONCAKE_TIMEOUT=MOONCAKE_TIMEOUT, HF_HUB_OFFLINE="1", MC_LOG_LEVEL="ERROR",
        MMKEY_ENTRY_AUTH="required", MMKEY_ENTRY_KEY_FILE=str(root / "entry.key"), OMP_NUM_THREADS="1",
    )  # fmt: skip
    env.pop("MMKEY_ENTRY_KEY", None)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if stand_in is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(stand_in), env.get("PYTHONPATH", "")) if p)
        env.setdefault("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--setup-only", action="store_true", help="build the model, start a master; no servers"
    )
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run these scenarios only")
    parser.add_argument("--keep", type=Path, help="copy the servers' logs into this folder")
    args = parser.parse_args(argv)

    import torch

    from mmkey.testing.fleet import running_fleet

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": None, "skipped": "no CUDA device"}))
        return 0
    kernel = sgl_kernel_kind()
    seen: dict[str, Any] = {"ok": False, "device": args.device, "sgl_kernel": kernel}
    # the real kernels where they load; elsewhere SGLang's kernel-free paths where it has a switch
    extra: tuple[str, ...] = () if kernel.startswith("real") else KERNEL_FREE_ARGS
    if args.device == "cpu":
        extra = ("--device", "cpu", *extra)
    seen["server_options"] = list(extra)
    started = time.monotonic()
    servers: dict[str, Server] = {}
    with (
        tempfile.TemporaryDirectory(prefix="mmkey-sglang-e2e-") as tmp,
        running_fleet(holders=1, segment_size=64 << 20) as fleet,
    ):
        root = Path(tmp)
        try:
            stand_in, model = prepare(root, kernel)
            if stand_in is not None:
                seen["sgl_kernel"] = "stand-in (written here: sglang-kernel is not installed)"
            if args.setup_only:
                seen.update(ok=True, setup_only=True, master=fleet.master.is_ready())
                print(json.dumps(seen))
                return 0
            env = server_env(root, fleet.master.address, args.device, stand_in)
            envs = {"a": dict(env, MMKEY_NAMESPACE=NAMESPACE), "b": dict(env, MMKEY_NAMESPACE=NAMESPACE),
                    "c": dict(env, MMKEY_NAMESPACE=OTHER_NAMESPACE, MMKEY_SGLANG_HASH="blake3"),
                    "ref": dict(env, MMKEY_NAMESPACE=NAMESPACE)}  # fmt: skip
            for name in SERVERS:
                servers[name] = start_server(name, model, envs[name], root, extra, global_cache=name != "ref")
            wait_healthy(list(servers.values()))
            seen["healthy_after_s"] = round(time.monotonic() - started, 1)
            run = Run(root, fleet, servers, lambda seed: image(root, seed))
            results: dict[str, Any] = {}
            for name, scenario in SCENARIOS.items():
                if args.only and name not in args.only:
                    continue
                try:
                    results[name] = scenario(run)
                except Exception as exc:
                    results[name] = {"errors": [f"{type(exc).__name__}: {exc}"[-2000:]]}
                try:
                    results[name]["held"] = held(name, results[name])
                except (KeyError, IndexError, TypeError):  # evidence missing: the scenario failed
                    results[name]["held"] = False
            seen["scenarios"] = results
            seen["tracebacks"] = {n: s.text().count("Traceback") for n, s in servers.items()}
            seen["ok"] = all(r["held"] for r in results.values()) and not any(seen["tracebacks"].values())
            if not seen["ok"]:
                seen["log_tails"] = {n: s.text()[-2500:] for n, s in servers.items()}
        except Exception as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        finally:
            for server in servers.values():
                server.stop()
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for server in servers.values():
                    (args.keep / server.log.name).write_bytes(server.log.read_bytes())
    seen["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(seen))
    return 0 if seen["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
