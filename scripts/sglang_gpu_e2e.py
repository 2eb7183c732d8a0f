"""Two SGLang encode servers on one GPU share an image's embedding through mmkey's store.

Run by ``scripts/gpu-check.sh`` in SGLang's environment (``.venv-sglang``) on a machine with
an NVIDIA GPU. It builds a tiny random-weight Qwen2-VL (a locally trained tokenizer, nothing
downloaded), starts a local ``mooncake_master``, then two encoder-only SGLang servers with
``--enable-mm-global-cache`` and ``MMKEY_SGLANG_BACKEND=1`` (pinned pools, embeddings copied
from CUDA by SGLang's ``store_to_pool_async``, SGLang's own feature hash). Server A encodes an
image and puts its embedding; server B is asked for the same image, finds it in the store
(``Global Hits: 1``), reads and verifies it and sends it on. Both send their embedding to a
ZMQ receiver standing in for the prefill side (``zmq_to_tokenizer``); the two must be equal.
Where ``sgl_kernel`` is the import stand-in of ``scripts/sgl_kernel_standin.py`` (the real
kernels don't load on this machine's torch), the servers take SGLang's kernel-free paths where
it offers a switch (``--mm-attention-backend sdpa``: torch's attention for the vision tower,
not FlashAttention 3 from sgl_kernel); a path that still needs a kernel raises. Prints one JSON
line: which ``sgl_kernel`` ran, what was seen, and ``ok``. Exit status 0 only when everything
held.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

NAMESPACE = "tiny-qwen2-vl@gpu-check"
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
START_TIMEOUT = 300.0
REQUEST_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(root: Path) -> Path:
    """A random-weight Qwen2-VL of a few million parameters, saved with its processor."""
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
    hidden = 128
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
        vision_config={"depth": 2, "embed_dim": 64, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = hf.Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    path = root / "tiny-qwen2-vl"
    model.save_pretrained(path)
    processor = hf.Qwen2VLProcessor(
        image_processor=hf.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224),
        video_processor=hf.Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(path)
    return path


def image(root: Path) -> str:
    image_module: Any = importlib.import_module("PIL.Image")

    path = root / "cat.png"
    pixels = bytes((x * 7 + y * 13) % 256 for y in range(112) for x in range(112 * 3))
    image_module.frombytes("RGB", (112, 112), pixels).save(path)
    return str(path)


#: server options that keep SGLang off sgl_kernel where it offers a switch (with the stand-in)
KERNEL_FREE_ARGS = ("--mm-attention-backend", "sdpa")


def sgl_kernel_kind() -> str:
    """``real VERSION``, ``stand-in`` (scripts/sgl_kernel_standin.py) or ``absent``: as
    scripts/gpu-check.sh found it, else imported in a child, so that a real kernel's ops
    library is not loaded into this process."""
    known = os.environ.get("MMKEY_GPU_CHECK_SGL_KERNEL")
    if known:
        return known
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


def start_server(
    model: Path, port: int, env: dict[str, str], log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--encoder-only",
        "--enable-mm-global-cache", "--mm-global-cache-backend", "mooncake",
        "--encoder-transfer-backend", "zmq_to_tokenizer", "--host", "127.0.0.1", "--port", str(port),
        "--mem-fraction-static", "0.1", "--trust-remote-code", *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_healthy(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    give_up = time.monotonic() + START_TIMEOUT
    while time.monotonic() < give_up:
        if server.poll() is not None:
            raise RuntimeError(f"server on {port} exited {server.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(
        f"server on {port} not healthy within {START_TIMEOUT:.0f} s: {log.read_text()[-3000:]}"
    )


def encode(port: int, req_id: str, path: str, receiver: Any, receiver_port: int) -> bytes:
    """POST /encode, then the embedding the server pushes to the stand-in prefill receiver."""
    body = {
        "req_id": req_id, "modality": "image", "mm_items": [path], "num_parts": 1, "part_idx": 0,
        "prefill_host": "127.0.0.1", "embedding_port": receiver_port,
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/encode", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
        if reply.status != 200:
            raise RuntimeError(f"/encode on {port}: HTTP {reply.status} {reply.read()[:500]!r}")
    if not receiver.poll(int(REQUEST_TIMEOUT * 1000)):
        raise RuntimeError(f"no embedding from the server on {port}")
    frames = receiver.recv_multipart()
    if len(frames) < 2:
        raise RuntimeError(f"the server on {port} sent no embedding bytes (an error?): {frames[0][:300]!r}")
    return bytes(frames[-1])


def stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> int:
    import torch

    zmq: Any = importlib.import_module("zmq")

    from mmkey.testing.mooncake_master import running_master

    if not torch.cuda.is_available():
        print(json.dumps({"ok": None, "skipped": "no CUDA device"}))
        return 0
    kernel = sgl_kernel_kind()
    stand_in = kernel == "stand-in"
    extra = KERNEL_FREE_ARGS if stand_in else ()
    seen: dict[str, Any] = {"ok": False, "sgl_kernel": kernel, "server_options": list(extra)}
    with tempfile.TemporaryDirectory(prefix="mmkey-gpu-check-") as tmp, running_master() as master:
        root = Path(tmp)
        model, picture = build_model(root), image(root)
        env = dict(os.environ)
        env.update(
            MMKEY_SGLANG_BACKEND="1", MMKEY_NAMESPACE=NAMESPACE, MOONCAKE_MASTER=master.address,
            MOONCAKE_PROTOCOL="tcp", MOONCAKE_GLOBAL_SEGMENT_SIZE="256MB",
            MOONCAKE_LOCAL_HOSTNAME="127.0.0.1", HF_HUB_OFFLINE="1", MC_LOG_LEVEL="ERROR",
        )  # fmt: skip
        if stand_in:  # SGLang's start checks the sglang-kernel distribution, which is absent
            env.setdefault("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")
        context = zmq.Context()
        receiver = context.socket(zmq.PULL)
        receiver_port = receiver.bind_to_random_port("tcp://127.0.0.1")
        servers: list[subprocess.Popen[bytes]] = []
        logs = [root / "server-a.log", root / "server-b.log"]
        try:
            ports = [free_port(), free_port()]
            for port, log in zip(ports, logs, strict=True):
                servers.append(start_server(model, port, env, log, extra))
            for port, server, log in zip(ports, servers, logs, strict=True):
                wait_healthy(port, server, log)
            first = encode(ports[0], "gpu-check-a", picture, receiver, receiver_port)
            time.sleep(2)  # SGLang's I/O thread puts the entry after the request returned
            second = encode(ports[1], "gpu-check-b", picture, receiver, receiver_port)
            texts = [log.read_text(errors="replace") for log in logs]
            seen.update(
                started=[t.count("mmkey SGLang store:") for t in texts],
                put=texts[0].count("Stored 1/1 embeddings"),
                global_hit=texts[1].count("Global Hits: 1"),
                fetched=texts[1].count("Successfully fetched 1/1"),
                same_embedding=first == second,
                embedding_bytes=len(first),
            )
            seen["ok"] = bool(
                all(seen["started"])
                and seen["put"]
                and seen["global_hit"]
                and seen["fetched"]
                and seen["same_embedding"]
            )
            if not seen["ok"]:
                seen["log_tails"] = [t[-2000:] for t in texts]
        except Exception as exc:
            seen["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        finally:
            for server in servers:
                stop(server)
            receiver.close(linger=0)
            context.term()
    print(json.dumps(seen))
    return 0 if seen["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
