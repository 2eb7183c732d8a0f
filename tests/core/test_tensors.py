"""`host_ready`: tensors read by another thread only after the caller's CUDA work on them."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from mmkey._tensors import HostReady, host_ready

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_cpu_tensors_record_nothing_and_wait_returns() -> None:
    ready = host_ready([torch.ones(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert ready == HostReady()
    assert ready.events == ()
    ready.wait()


def test_non_tensors_and_empty_input_record_nothing() -> None:
    assert host_ready([]).events == ()
    assert host_ready([1, "x", None, torch.empty(2, device="meta")]).events == ()


def test_cpu_tensors_do_not_initialise_cuda() -> None:
    out = run_python(
        "import torch\n"
        "from mmkey._tensors import host_ready\n"
        "host_ready([torch.ones(4), torch.arange(3)]).wait()\n"
        "print(torch.cuda.is_initialized())"
    )
    assert out == "False"


def test_without_torch_loaded_nothing_is_imported() -> None:
    out = run_python(
        "import sys\n"
        "from mmkey._tensors import host_ready\n"
        "host_ready([b'not a tensor']).wait()\n"
        "print('torch' in sys.modules)"
    )
    assert out == "False"


def read_in_thread(tensor: torch.Tensor, ready: HostReady | None) -> torch.Tensor:
    """`tensor` copied to the CPU by another thread, after `ready.wait()` when given."""
    result: list[torch.Tensor] = []

    def reader() -> None:
        if ready is not None:
            ready.wait()
        result.append(tensor.cpu())

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return result[0]


def write_late_on_side_stream(device: torch.device) -> tuple[torch.Tensor, HostReady | None]:
    """A zero tensor that a side stream overwrites with 7 after a long kernel; the host_ready
    of that moment, recorded on the writing thread while the side stream is current."""
    x = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s of cycles
        x.fill_(7.0)
        ready = host_ready([x])
    return x, ready


@pytest.mark.gpu
@needs_cuda
def test_reader_thread_sees_side_stream_writes_after_wait() -> None:  # pragma: no cover
    x, ready = write_late_on_side_stream(torch.device("cuda", 0))
    assert ready is not None and len(ready.events) == 1
    assert torch.equal(read_in_thread(x, ready), torch.full((1 << 20,), 7.0))


@pytest.mark.gpu
@needs_cuda
def test_the_race_is_real_without_the_wait() -> None:  # pragma: no cover
    # The control for the test above: another thread's copy runs on its own current stream
    # and does not wait for the side stream, so it reads the tensor before the write.
    x, _ = write_late_on_side_stream(torch.device("cuda", 0))
    seen = read_in_thread(x, None)
    torch.cuda.synchronize()
    assert not torch.equal(seen, torch.full((1 << 20,), 7.0))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_one_event_per_device_on_each_current_stream() -> None:  # pragma: no cover
    tensors = []
    for index in (1, 0):
        device = torch.device("cuda", index)
        tensors.append(torch.zeros(4, device=device))
        tensors.append(torch.ones(4, device=device))
    ready = host_ready(tensors)
    assert len(ready.events) == 2
    ready.wait()
    assert all(e.query() for e in ready.events)  # type: ignore[no-untyped-call]
