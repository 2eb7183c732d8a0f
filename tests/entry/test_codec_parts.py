"""Entries whose payload lies in several tensors: `entry_header` and `decode_entry_into`.

A pool of pages holds one embedding in row slices that are not adjacent in memory. The
header `entry_header` makes of those slices, followed by their bytes, must be the entry
`encode_entry` makes of their concatenation; `decode_entry_into` must verify an entry
before it writes any target, and then land exactly the payload's bytes in them.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import attrs
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mmkey.entry._encode as codec_encode
from mmkey import CorruptEntry, EntryKeyring, InvalidKey
from mmkey.entry.codec import (
    DTYPE_CODES,
    EntryHeader,
    decode_entry,
    decode_entry_into,
    encode_entry,
    entry_header,
    peek_header,
    verify,
    verify_entry,
    verify_entry_into,
)
from mmkey.errors import ForgedEntry
from mmkey.testing.strategies import key_texts

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

KEY = "mmk1@qwen2-vl-7b@image@blake3@000000000000000000000000000000a7"
OTHER_KEY = "mmk1@qwen2-vl-7b@image@blake3@000000000000000000000000000000a8"
SECRET = hashlib.sha256(b"codec parts test secret").digest()
RING = EntryKeyring.from_secrets(SECRET)
MIGRATING = attrs.evolve(RING, migrate_until=datetime.datetime(2999, 1, 1, tzinfo=datetime.timezone.utc))
OTHER_RING = EntryKeyring.from_secrets(hashlib.sha256(b"another fleet").digest())
NOW = 1_796_000_000
"""The issue time signed entries of these tests carry (entries compared byte for byte)."""


@pytest.fixture(autouse=True, scope="module")
def fixed_clock() -> Iterator[None]:
    real, codec_encode._clock = codec_encode._clock, lambda: NOW
    yield
    codec_encode._clock = real


DTYPE_NAMES = tuple(name for name in DTYPE_CODES if isinstance(getattr(torch, name, None), torch.dtype))
"""Every dtype of `DTYPE_CODES` this torch can make."""


def raw(t: torch.Tensor) -> bytes:
    """The bytes of contiguous `t`, whatever its dtype (NaN payloads included)."""
    assert t.is_contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


@attrs.frozen
class Layout:
    """Where the runs of one embedding lie in a pool of rows."""

    rows: tuple[int, ...]
    """Rows of each run, in the entry's order."""
    order: tuple[int, ...]
    """The runs (indices into `rows`) in the order they lie in the pool."""
    gaps: tuple[int, ...]
    """Free rows before each run in pool order, and after the last."""


@attrs.frozen
class Case:
    """One embedding (dtype, shape) split two ways: as written and as read back."""

    dtype: str
    rest: tuple[int, ...]
    """All dimensions but the first."""
    scalar: bool
    """The payload is a single 0-d tensor (then `rest` is () and both layouts one row)."""
    source: Layout
    target: Layout
    seed: int
    key: str
    signed: bool


@attrs.frozen
class Placed:
    """A pool and the runs of one embedding in it."""

    pool: torch.Tensor
    runs: list[torch.Tensor]
    starts: list[int]
    """The first pool row of each run."""


def place(
    layout: Layout, dtype: torch.dtype, rest: tuple[int, ...], scalar: bool, seed: int | None
) -> Placed:
    """A contiguous pool (random bytes, or zeros when `seed` is None) and `layout`'s runs in it."""
    starts = [0] * len(layout.rows)
    at = 0
    for slot, run in enumerate(layout.order):
        at += layout.gaps[slot]
        starts[run] = at
        at += layout.rows[run]
    rows = at + layout.gaps[-1]
    size = rows * math.prod(rest) * dtype.itemsize
    if seed is None:
        data = torch.zeros(size, dtype=torch.uint8)
    else:
        generator = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        if dtype == torch.bool:
            data &= 1
    pool = data.view(dtype).reshape(rows, *rest)
    if scalar:
        runs = [pool[start] for start in starts]
    else:
        runs = [pool[start : start + n] for start, n in zip(starts, layout.rows, strict=True)]
    return Placed(pool, runs, starts)


def joined(case: Case, placed: Placed) -> tuple[bytes, bytes]:
    """The header `entry_header` makes of the runs, and that header followed by their bytes."""
    head = entry_header(case.key, placed.runs, keyring=RING if case.signed else None)
    return head, head + b"".join(raw(run) for run in placed.runs)


def concatenation(placed: Placed, scalar: bool) -> torch.Tensor:
    """The embedding the runs hold: their concatenation along the first dimension."""
    return placed.runs[0] if scalar else torch.cat(placed.runs)


@st.composite
def layouts(draw: st.DrawFn, total: int) -> Layout:
    """Any split of `total` rows into 1 to 4 runs (zero-row runs included), placed apart."""
    count = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=count - 1, max_size=count - 1)))
    bounds = [0, *cuts, total]
    rows = tuple(b - a for a, b in itertools.pairwise(bounds))
    order = tuple(draw(st.permutations(range(count))))
    gaps = tuple(draw(st.lists(st.integers(1, 2), min_size=count + 1, max_size=count + 1)))
    return Layout(rows, order, gaps)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Any dtype, 1 to 4 dimensions (zero-length ones included), two splits, key, signer."""
    ndim = draw(st.integers(1, 4))
    rest = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim - 1, max_size=ndim - 1)))
    total = draw(st.integers(0, 9))
    return Case(
        dtype=draw(st.sampled_from(DTYPE_NAMES)),
        rest=rest,
        scalar=False,
        source=draw(layouts(total)),
        target=draw(layouts(total)),
        seed=draw(st.integers(0, 2**32 - 1)),
        key=draw(key_texts()),
        signed=draw(st.booleans()),
    )


ONE_RUN = Case("float32", (3,), False, Layout((5,), (0,), (1, 1)), Layout((5,), (0,), (2, 1)), 1, KEY, False)
ZERO_ROW_AMONG_OTHERS = Case(
    "bfloat16",
    (2, 3),
    False,
    Layout((2, 0, 3), (2, 0, 1), (1, 1, 1, 1)),
    Layout((0, 4, 1), (1, 2, 0), (1, 2, 1, 1)),
    2,
    KEY,
    True,
)
SCALAR = Case("complex64", (), True, Layout((1,), (0,), (1, 1)), Layout((1,), (0,), (2, 1)), 3, KEY, True)


@settings(max_examples=300)
@given(case=cases())
@example(case=ONE_RUN)
@example(case=ZERO_ROW_AMONG_OTHERS)
@example(case=SCALAR)
@example(case=attrs.evolve(SCALAR, signed=False, dtype="bits1x8"))
@example(case=attrs.evolve(ZERO_ROW_AMONG_OTHERS, dtype="float8_e8m0fnu", rest=(0, 3)))
def test_split_payload_entries_are_the_joined_entries(case: Case) -> None:
    dtype = getattr(torch, case.dtype)
    keyring = RING if case.signed else None
    source = place(case.source, dtype, case.rest, case.scalar, case.seed)
    pool_before = raw(source.pool)
    whole = concatenation(source, case.scalar)
    head, entry = joined(case, source)

    # (a) the header and the runs' bytes are, byte for byte, the entry of their concatenation
    assert entry == encode_entry(case.key, whole, keyring=keyring)
    assert entry_header(case.key, whole, keyring=keyring) == head
    assert entry_header(case.key, tuple(source.runs), keyring=keyring) == head

    # (b) the joined entry reads back like any other
    back = decode_entry(case.key, entry, keyring=keyring)
    assert (back.dtype, back.shape) == (dtype, whole.shape)
    assert raw(back) == raw(whole)
    key_id = RING.current.key_id if case.signed else None
    issued = NOW if case.signed else None
    assert peek_header(entry) == EntryHeader(
        case.key, dtype, tuple(whole.shape), len(head), len(entry) - len(head), key_id, issued
    )

    # (c) read into another split of a zeroed pool: the payload lands in the target rows only
    target = place(case.target, dtype, case.rest, case.scalar, None)
    decode_entry_into(case.key, entry, target.runs, keyring=keyring)
    row = math.prod(case.rest) * dtype.itemsize
    want = bytearray(target.pool.numel() * dtype.itemsize)
    payload = entry[len(head) :]
    at = 0
    for start, run in zip(target.starts, target.runs, strict=True):
        size = run.numel() * dtype.itemsize
        want[start * row : start * row + size] = payload[at : at + size]
        at += size
    assert at == len(payload)
    assert raw(target.pool) == bytes(want)
    assert raw(source.pool) == pool_before


# -- failures: the targets stay as they were --------------------------------------------------


def pages(
    rows: Sequence[int] = (2, 1, 3),
    rest: tuple[int, ...] = (4,),
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> Placed:
    """Runs of `rows` rows in a pool (zeros unless seeded), one free row around each."""
    count = len(rows)
    layout = Layout(tuple(rows), tuple(range(count)), (1,) * (count + 1))
    return place(layout, dtype, rest, False, seed)


def written(signed: bool = False) -> bytes:
    """The entry, under `KEY`, of float32 (6, 4) in three runs (`expected()` holds its value)."""
    source = pages(seed=11)
    head = entry_header(KEY, source.runs, keyring=RING if signed else None)
    return head + b"".join(raw(run) for run in source.runs)


def expected() -> torch.Tensor:
    """The tensor `written()` holds."""
    return torch.cat(pages(seed=11).runs)


def assert_zero(placed: Placed) -> None:
    """No byte of the pool (targets and the rows around them) was written."""
    assert not any(raw(placed.pool)), "a target was written"


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
def test_key_echo_mismatch_is_corrupt(signed: bool) -> None:
    entry = written(signed)
    target = pages()
    with pytest.raises(CorruptEntry, match="written under key .*a7.*read as .*a8"):
        decode_entry_into(OTHER_KEY, entry, target.runs, keyring=RING if signed else None)
    assert_zero(target)


def test_every_flipped_bit_of_an_entry_is_corrupt() -> None:
    entry = written()
    target = pages()
    for bit in range(len(entry) * 8):
        damaged = bytearray(entry)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptEntry):
            decode_entry_into(KEY, damaged, target.runs)
    assert_zero(target)


def test_every_flipped_bit_of_a_signed_entry_is_refused() -> None:
    """Outside the MAC field a flip also breaks the checksum (corrupt); in it, a forgery."""
    entry = written(signed=True)
    target = pages()
    mac = range(40 * 8, 72 * 8)
    for bit in range(len(entry) * 8):
        damaged = bytearray(entry)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ForgedEntry if bit in mac else CorruptEntry):
            decode_entry_into(KEY, damaged, target.runs, keyring=RING)
    assert_zero(target)


@pytest.mark.parametrize(
    ("targets", "took"),
    [
        (pages(dtype=torch.int32), "torch.int32 (6, 4)"),
        (pages(dtype=torch.bfloat16), "torch.bfloat16 (6, 4)"),
        (pages(rows=(2, 1, 2)), "torch.float32 (5, 4)"),
        (pages(rows=(2, 1, 4)), "torch.float32 (7, 4)"),
        (pages(rest=(3,)), "torch.float32 (6, 3)"),
        (pages(rest=(2, 2)), "torch.float32 (6, 2, 2)"),
        (pages(rows=(20, 4), rest=()), "torch.float32 (24,)"),
        (pages(rows=(3, 1), rest=(6,)), "torch.float32 (4, 6)"),
    ],
    ids=[
        "dtype-same-size",
        "dtype",
        "fewer-rows",
        "more-rows",
        "trailing",
        "more-dims",
        "fewer-dims",
        "rows-and-trailing",
    ],
)
def test_targets_of_another_dtype_or_shape_are_corrupt(targets: Placed, took: str) -> None:
    holds = "holds torch.float32 \\(6, 4\\), the targets take"
    with pytest.raises(CorruptEntry, match=holds) as caught:
        decode_entry_into(KEY, written(), targets.runs)
    assert took in str(caught.value)
    assert_zero(targets)


def test_keyring_reader_refuses_unsigned_entries_unless_migrating() -> None:
    entry = written()
    target = pages()
    with pytest.raises(ForgedEntry, match="carries no MAC"):
        decode_entry_into(KEY, entry, target.runs, keyring=RING)
    assert_zero(target)
    decode_entry_into(KEY, entry, target.runs, keyring=MIGRATING)
    assert raw(torch.cat(target.runs)) == raw(expected())


def test_entries_signed_with_another_secret_are_forged() -> None:
    target = pages()
    source = pages(seed=11)
    head = entry_header(KEY, source.runs, keyring=OTHER_RING)
    entry = head + b"".join(raw(run) for run in source.runs)
    with pytest.raises(ForgedEntry, match="does not hold"):
        decode_entry_into(KEY, entry, target.runs, keyring=RING)
    with pytest.raises(ForgedEntry, match="does not hold"):
        decode_entry_into(KEY, entry, target.runs, keyring=MIGRATING)
    assert_zero(target)
    decode_entry_into(KEY, entry, target.runs, keyring=OTHER_RING)
    assert raw(torch.cat(target.runs)) == raw(expected())


def test_signed_entries_read_without_a_keyring_after_their_checksum() -> None:
    target = pages()
    decode_entry_into(KEY, written(signed=True), target.runs)
    assert raw(torch.cat(target.runs)) == raw(expected())


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
def test_truncated_or_extended_entries_are_corrupt(signed: bool) -> None:
    entry = written(signed)
    target = pages()
    keyring = RING if signed else None
    for size in range(len(entry)):
        with pytest.raises(CorruptEntry):
            decode_entry_into(KEY, entry[:size], target.runs, keyring=keyring)
    for extra in (b"\0", b"\0" * 4, b"\0" * 64, entry):
        with pytest.raises(CorruptEntry, match="extended entry"):
            decode_entry_into(KEY, entry + extra, target.runs, keyring=keyring)
    assert_zero(target)


def test_entries_are_read_from_any_bytes_like_buffer() -> None:
    entry = written()
    assert len(entry) % 4 == 0
    buffers = (
        bytearray(entry),
        memoryview(entry),
        memoryview(bytearray(entry)).cast("B", (2, len(entry) // 2)),
        memoryview(entry).cast("I"),
    )
    for data in buffers:
        target = pages()
        decode_entry_into(KEY, data, target.runs)
        assert raw(torch.cat(target.runs)) == raw(expected())
    single = torch.zeros(6, 4)
    decode_entry_into(KEY, entry, single)
    assert raw(single) == raw(expected())


# -- bad input: clear errors, nothing written ---------------------------------------------------


def conj_tensor() -> torch.Tensor:
    """A contiguous CPU tensor whose conj bit is set (its bytes are not its values)."""
    t = torch.zeros(2, 4, dtype=torch.complex64).conj()
    assert t.is_conj() and t.is_contiguous()
    return t


def uncoded(name: str) -> torch.Tensor:
    """A (6, 4) CPU tensor of a torch dtype that has no entry code (torch's stubs omit it)."""
    dtype: torch.dtype = getattr(torch, name)
    assert name not in DTYPE_CODES
    return torch.zeros(6, 4, dtype=torch.uint8).view(dtype)


NOT_RUNS = "torch.Tensor or a non-empty list"
SHARED = "all but their first dimension"
BAD_RUNS = [
    pytest.param(b"\0" * 96, TypeError, NOT_RUNS, id="bytes"),
    pytest.param(None, TypeError, NOT_RUNS, id="none"),
    pytest.param([], TypeError, NOT_RUNS, id="empty-list"),
    pytest.param((), TypeError, NOT_RUNS, id="empty-tuple"),
    pytest.param(iter([torch.zeros(6, 4)]), TypeError, NOT_RUNS, id="iterator"),
    pytest.param(
        [torch.zeros(2, 4), [0.0] * 4], TypeError, "must be torch.Tensor, got list", id="non-tensor-run"
    ),
    pytest.param(
        [torch.zeros(2, 4), torch.zeros(8, 4)[::2]], ValueError, "a non-contiguous", id="non-contiguous"
    ),
    pytest.param(torch.zeros(4, 6).t(), ValueError, "a non-contiguous", id="transposed"),
    pytest.param([torch.zeros(2, 4), torch.zeros(4, 4, device="meta")], ValueError, "on meta", id="meta"),
    pytest.param(
        [torch.zeros(2, 4, dtype=torch.complex64), conj_tensor()], ValueError, "without conj/neg", id="conj"
    ),
    pytest.param(
        [torch.zeros(2, 4), torch._neg_view(torch.zeros(4, 4))], ValueError, "without conj/neg", id="neg"
    ),
    pytest.param(
        [torch.zeros(2, 4), torch.zeros(4, 4, dtype=torch.float64)],
        ValueError,
        "share one dtype",
        id="dtypes",
    ),
    pytest.param([torch.zeros(2, 4), torch.zeros(4, 3)], ValueError, SHARED, id="trailing"),
    pytest.param([torch.zeros(2, 4), torch.zeros(())], ValueError, SHARED, id="0-d-among"),
    pytest.param([uncoded("int4")], TypeError, "cannot store dtype torch.int4", id="no-code"),
    pytest.param(uncoded("uint4"), TypeError, "cannot store dtype torch.uint4", id="no-code-1"),
]
"""Payloads / targets that are not the runs of one entry: what each raises, and the words."""


@pytest.mark.parametrize(("runs", "error", "message"), BAD_RUNS)
def test_entry_header_refuses_bad_payloads(runs: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        entry_header(KEY, runs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("runs", "error", "message"), BAD_RUNS)
def test_decode_entry_into_refuses_bad_targets_before_writing(
    runs: object, error: type[Exception], message: str
) -> None:
    good = torch.zeros(3, 4)
    # a valid target ahead of the bad one (behind the first run, whose dtype counts)
    targets = [runs[0], good, *runs[1:]] if isinstance(runs, list) and runs else runs
    with pytest.raises(error, match=message):
        decode_entry_into(KEY, written(), targets)  # type: ignore[arg-type]
    assert not good.any()


def test_bad_keys_data_and_keyrings_are_refused_before_writing() -> None:
    target = pages()
    entry = written()
    with pytest.raises(TypeError, match="key text"):
        decode_entry_into(7, entry, target.runs)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match="not ASCII"):
        decode_entry_into("mmk1@é", entry, target.runs)
    with pytest.raises(TypeError, match="got str"):
        decode_entry_into(KEY, entry.decode("latin-1"), target.runs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):
        decode_entry_into(KEY, 12, target.runs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EntryKeyring"):
        decode_entry_into(KEY, entry, target.runs, keyring=SECRET)  # type: ignore[arg-type]
    assert_zero(target)
    with pytest.raises(TypeError, match="key text"):
        entry_header(7, target.runs)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey):
        entry_header("", target.runs)
    with pytest.raises(TypeError, match="EntryKeyring"):
        entry_header(KEY, target.runs, keyring=SECRET)  # type: ignore[arg-type]


def layouts_other_than_strided() -> list[object]:
    """Tensors of a non-strided layout, (2, 4) float32 like the first target of `pages()`."""
    made: list[object] = [
        pytest.param(lambda: torch.zeros(2, 4).to_sparse(), id="sparse_coo"),
        pytest.param(lambda: torch.zeros(2, 4).to_sparse_csr(), id="sparse_csr"),
    ]
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # untyped in torch
        made.append(pytest.param(lambda: torch.zeros(2, 4).to_mkldnn(), id="mkldnn"))
    return made


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make", layouts_other_than_strided())
def test_tensors_of_another_layout_are_type_errors_and_write_nothing(
    make: Callable[[], torch.Tensor],
) -> None:
    with pytest.raises(TypeError, match="layout|sparse|mkldnn"):
        entry_header(KEY, [torch.zeros(1, 4), make()])
    good = torch.zeros(1, 4)
    with pytest.raises(TypeError, match="layout|sparse|mkldnn"):
        decode_entry_into(KEY, written(), [good, make(), torch.zeros(3, 4)])
    assert not good.any()


def test_verify_is_the_one_read_and_the_old_names_are_its_aliases() -> None:
    want = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    signed = encode_entry(KEY, want, keyring=RING)
    plain = encode_entry(KEY, want)
    got, unsigned = verify(KEY, signed, keyring=RING)
    assert torch.equal(got, want) and unsigned is False
    assert verify(KEY, plain, keyring=MIGRATING)[1] is True
    alias, data = verify(KEY, bytearray(plain), copy=False), bytearray(plain)
    assert torch.equal(alias[0], want) and alias[1] is False
    view = verify(KEY, data, copy=False)[0]
    data[-4:] = torch.tensor([-1.0]).numpy().tobytes()
    assert view[2, 3] == -1.0  # a view of the caller's buffer, as asked
    runs = [torch.zeros(1, 4), torch.zeros(2, 4)]
    assert verify(KEY, plain, runs) == (None, False)
    assert torch.equal(torch.cat(runs), want)
    assert verify(KEY, plain, torch.zeros(3, 4), keyring=MIGRATING) == (None, True)
    with pytest.raises(ValueError, match="leave copy=True with into"):
        verify(KEY, plain, torch.zeros(3, 4), copy=False)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"verify\(\) takes its into"):
        verify(KEY, plain, 5)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"decode_entry_into\(\) takes its targets"):
        decode_entry_into(KEY, plain, None)  # type: ignore[arg-type]
    assert torch.equal(decode_entry(KEY, signed, keyring=RING), want)
    assert verify_entry_into(KEY, plain, torch.zeros(3, 4), keyring=MIGRATING) is True
    assert [(torch.equal(t, want), u) for t, u in [verify_entry(KEY, plain)]] == [(True, False)]
