"""The serving benchmark's trace generator, client, percentiles and tables (seeded, exact)."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._support import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
loadgen: Any = importlib.import_module("loadgen")
serve_tables: Any = importlib.import_module("serve_tables")


def test_a_trace_is_seeded_and_repeats_the_share_asked() -> None:
    trace = loadgen.make_trace(200, 0.8, seed=7)
    assert trace == loadgen.make_trace(200, 0.8, seed=7)
    assert trace != loadgen.make_trace(200, 0.8, seed=8)
    assert loadgen.repeat_share(trace) == pytest.approx(0.8)
    assert trace[0] == 0
    # new images are numbered in order of first use
    firsts = [image for i, image in enumerate(trace) if image not in trace[:i]]
    assert firsts == list(range(len(firsts)))
    assert loadgen.repeat_share(loadgen.make_trace(10, 0.0, seed=1)) == 0.0
    assert loadgen.make_trace(5, 1.0, seed=1) == [0, 0, 0, 0, 0]  # the first is always new


def test_repeats_favour_the_first_images_seen() -> None:
    trace = loadgen.make_trace(2000, 0.8, seed=3)
    counts = [trace.count(i) for i in range(3)]
    later = max(trace.count(i) for i in range(50, max(trace) + 1))
    assert counts[0] > counts[1] > counts[2] > later


def test_a_trace_refuses_a_share_out_of_range() -> None:
    with pytest.raises(ValueError, match="repeats"):
        loadgen.make_trace(10, 1.5, seed=0)


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert loadgen.percentile(values, 0.5) == pytest.approx(50.5)
    assert loadgen.percentile(values, 0.99) == pytest.approx(99.01)
    assert loadgen.percentile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert loadgen.percentile([3.0, 1.0, 2.0], 1.0) == 3.0
    with pytest.raises(ValueError):
        loadgen.percentile([], 0.5)


def test_a_table_is_markdown() -> None:
    table = loadgen.format_table(["row", "ms"], [["a", 1.25], ["b", 3]])
    assert table.splitlines() == ["| row | ms |", "|---|---|", "| a | 1.2 |", "| b | 3 |"]
    with pytest.raises(ValueError):
        loadgen.format_table(["row", "ms"], [["a"]])


def test_the_client_only_speaks_to_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(loadgen.stream_post("10.0.0.1", 80, "/", {}, 1.0))


def test_the_client_times_a_chunked_stream_and_replay_bounds_clients() -> None:
    in_flight, most = 0, 0
    paired = asyncio.Event()  # two streams were open at once: the first ones end no sooner

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        if in_flight == 2:
            paired.set()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.wait_for(paired.wait(), 10.0)
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()
        in_flight -= 1

    async def main() -> tuple[list[Any], float]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            sends = [lambda: loadgen.stream_post("127.0.0.1", port, "/x", {"a": 1}, 10.0) for _ in range(6)]
            result: tuple[list[Any], float] = await loadgen.replay(sends, 2)
            return result

    outcomes, wall = asyncio.run(main())
    assert len(outcomes) == 6 and all(o.ok for o in outcomes)
    assert all(o.body == b"hello world" and o.first < o.total for o in outcomes)
    assert most == 2
    assert wall > 0


def test_a_refused_connection_is_an_outcome_not_an_exception() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = asyncio.run(loadgen.stream_post("127.0.0.1", port, "/", {}, 2.0))
    assert not out.ok and out.status == 0 and "Error" in out.error


def _outcomes(ms: list[float], failed: int = 0) -> list[Any]:
    done = [loadgen.Outcome(v / 1e3, v / 1e3, 200) for v in ms]
    return done + [loadgen.Outcome(1.0, 1.0, 0, "refused")] * failed


def test_summaries_and_targets() -> None:
    counts = {"tower_images": 10.0, "tower_s": 1.0}
    none = serve_tables.summarize("none", 0.8, 4, _outcomes([100.0] * 9 + [200.0]), 2.0, counts)
    assert none.rate == 5.0 and none.p50 == 100.0 and none.hit_rate == 0.0 and none.tower_ms == 100.0
    mm_counts = {"tower_images": 2.0, "tower_s": 0.2, "loaded_bytes": 3 << 20, "saved_bytes": 1 << 20}
    mmkey = serve_tables.summarize("mmkey", 0.8, 4, _outcomes([20.0] * 9, failed=1), 1.0, mm_counts)
    assert mmkey.failed == 1 and mmkey.hit_rate == pytest.approx(0.8) and mmkey.moved_bytes == 4 << 20
    fault = serve_tables.summarize("mmkey, store paused", 0.8, 4, _outcomes([1500.0]), 1.0, {})
    report = serve_tables.Report(
        cells=[none, mmkey],
        fault=fault,
        hit_ms={"lookup": 1.0, "fetch": 2.0},
        timeout_s=1.0,
        load=1.5,
        minutes=2.0,
        engines=2,
        requests=10,
    )
    lines = serve_tables.targets(report)
    assert lines[0] == "hit path <= 5% of the tower: 3.0% (met)"
    assert "80% below none (met)" in lines[1]
    assert "mmkey 20 ms, none 191 ms (met)" in lines[2]
    assert lines[3].endswith("bound none p99 + 1.0 s = 1191 ms (missed)")
    text = serve_tables.render(report, 576, "CLIP")
    assert "| mmkey, 4 clients | 10.0 | 20.0 |" in text and "load average up to 1.5" in text
    assert "less its own tower time" not in text, "no request's tower time was measured"


def test_one_clients_requests_less_their_own_tower_time() -> None:
    timed = [loadgen.Outcome(v / 1e3, v / 1e3, 200, tower=t / 1e3) for v, t in [(110, 100), (15, 0)] * 50]
    cell = serve_tables.summarize("mmkey", 0.5, 1, timed, 1.0, {"tower_images": 50.0, "tower_s": 5.0})
    assert cell.beside == (pytest.approx(12.5), pytest.approx(15.0))
    failed = [*timed, loadgen.Outcome(1.0, 1.0, 0, "refused")]  # a failure carries no tower time
    assert serve_tables.summarize("mmkey", 0.5, 1, failed, 1.0, {}).beside == cell.beside
    untimed = [*timed, loadgen.Outcome(0.2, 0.2, 200)]
    assert serve_tables.summarize("mmkey", 0.5, 1, untimed, 1.0, {}).beside is None
    report = serve_tables.Report(
        cells=[cell], fault=None, hit_ms={}, timeout_s=1.0, load=0.5, minutes=1.0, engines=2, requests=100
    )
    text = serve_tables.render(report, 576, "CLIP")
    assert "TTFT less its own tower time" in text and "| mmkey | 50% | 12.5 | 15.0 |" in text


def test_rows_run_back_to_back_per_cell_and_take_turns_going_first() -> None:
    rows = ["none", "sglang", "mmkey"]
    plan = [(0.5, 1), (0.5, 4), (0.8, 1), (0.8, 4)]
    order = loadgen.interleaved(rows, plan)
    assert sorted(order) == sorted((row, cell) for row in rows for cell in plan)  # each once
    for k, cell in enumerate(plan):
        runs = order[3 * k : 3 * k + 3]
        assert {c for _, c in runs} == {cell}, "a cell's rows run back to back"
        assert runs[0][0] == rows[k % 3]
    assert loadgen.interleaved(["mmkey"], plan) == [("mmkey", cell) for cell in plan]


def test_by_cell_groups_each_cell_with_its_rows_in_running_order() -> None:
    rows = ["none", "sglang", "mmkey"]
    plan = [(0.5, 1), (0.8, 16)]
    assert loadgen.by_cell(loadgen.interleaved(rows, plan)) == [
        ((0.5, 1), ["none", "sglang", "mmkey"]),
        ((0.8, 16), ["sglang", "mmkey", "none"]),
    ]


def test_rows_take_turns_one_request_at_a_time_the_first_row_turning() -> None:
    sent: list[str] = []
    in_flight: list[int] = [0]

    def send(tag: str) -> Any:
        async def go() -> Any:
            in_flight[0] += 1
            assert in_flight[0] == 1, "one request at a time"
            sent.append(tag)
            await asyncio.sleep(0)
            in_flight[0] -= 1
            return loadgen.Outcome(0.0, 0.0, 200, body=tag.encode())

        return go

    rows = [(row, [send(f"{row}{i}") for i in range(n)]) for row, n in (("a", 12), ("b", 12), ("c", 11))]
    done = asyncio.run(loadgen.turns(rows))
    turns = [sorted(sent[3 * i : 3 * i + 3]) for i in range(11)]
    assert turns == [[f"a{i}", f"b{i}", f"c{i}"] for i in range(11)], "request i of each row before i + 1"
    assert sorted(sent[33:]) == ["a11", "b11"]  # c has only eleven
    assert [o.body for o in done["a"][0]] == [f"a{i}".encode() for i in range(12)], "in its order"
    assert [len(done[r][0]) for r in "abc"] == [12, 12, 11]
    # the first 6 turns are the 6 orders of three rows: each row first twice, right after each
    # other row twice
    orders = [tuple(tag[0] for tag in sent[3 * i : 3 * i + 3]) for i in range(6)]
    assert sorted(orders) == sorted(itertools.permutations("abc"))
    assert orders[0] == tuple(tag[0] for tag in sent[18:21]), "then the same orders again"
    assert orders != sorted(orders), "in a seeded shuffle, not lexical order"
    assert all(seconds >= 0.0 for _, seconds in done.values())
    with pytest.raises(ValueError, match="each row once"):
        asyncio.run(loadgen.turns([("a", []), ("a", [])]))


def test_a_rows_seconds_are_the_time_its_own_requests_took() -> None:
    now = [0.0]

    def taking(seconds: float) -> Any:
        async def go() -> Any:
            now[0] += seconds  # the request's own time, on the injected clock
            return loadgen.Outcome(seconds, seconds, 200)

        return go

    rows = [("quick", [taking(0.01)] * 2), ("slow", [taking(0.5)] * 2)]
    done = asyncio.run(loadgen.turns(rows, clock=lambda: now[0]))
    assert done["quick"][1] == pytest.approx(0.02) and done["slow"][1] == pytest.approx(1.0)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs"
)
def test_servers_run_on_one_core_and_the_rest_beside_them_then_everything_moves_back() -> None:
    allowed = os.sched_getaffinity(0)
    # stand-ins that block until killed: a server with a second thread, and another child
    code = (
        "import sys, threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "sys.stdin.read()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        started = wait_until(lambda: len(os.listdir(f"/proc/{server.pid}/task")) >= 2, 20)
        assert started, "the server's second thread never started"

        def cpus(pid: int) -> set[frozenset[int]]:
            return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}

        with loadgen.servers_on_one_core([server.pid]) as core:
            assert core == max(allowed)
            assert cpus(server.pid) == {frozenset({core})}, "every thread of the server"
            assert cpus(other.pid) == {frozenset(allowed - {core})}, "another child of this process"
            assert cpus(os.getpid()) == {frozenset(allowed - {core})}
        for pid in (server.pid, other.pid, os.getpid()):
            assert cpus(pid) == {frozenset(allowed)}
    finally:
        for child in (server, other):
            child.kill()
            child.wait()


def test_counters_gained_are_summed_over_the_servers() -> None:
    before = [{"tower_s": 1.0, "hits": 2.0}, {"tower_s": 0.5}]
    after = [{"tower_s": 3.0, "hits": 2.0}, {"tower_s": 1.0, "hits": 4.0}]  # a counter new since
    assert loadgen.gained(before, after) == {"tower_s": 2.5, "hits": 4.0}
    with pytest.raises(ValueError):
        loadgen.gained(before, after[:1])
