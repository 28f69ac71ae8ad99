"""Reading nvme blocks back (tiers/nvme_stored.py and tiers/native/verify.c): a checksum on
every read, a batch read in one transaction, and the native verified copy against xxhash.

The rest of what only the nvme tier does is in test_nvme_tier.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest
import xxhash

from tests.nvme_fixtures import FP, WriterGate, config, key, payload, raw_env, reopen
from tests.tier_factories import read
from tiers import Codec
from tiers.nvme import NvmeConfig, NvmeTier
from tiers.nvme_stored import VERIFY_CHUNK_BYTES, verified_copy_py

__all__ = ["config"]


# ---- corruption ----------------------------------------------------------------------------------


# one chunk hashed then copied, and several (the last one short), flipped in the last chunk
@pytest.mark.parametrize("size", [100_000, 3 * VERIFY_CHUNK_BYTES + 4321])
def test_corrupt_payload_is_a_counted_miss_and_is_deleted(config: NvmeConfig, size: int) -> None:
    tier = NvmeTier(config)
    tier.put(key(1), payload(1, size), FP)
    tier.put(key(2), payload(2, size), FP)
    tier.close()
    with raw_env(config) as env:
        payloads = env.open_db(b"payloads")
        with env.begin(write=True, db=payloads) as txn:
            stored = bytearray(txn.get(key(1)) or b"")
            stored[size - 5000] ^= 0xFF  # one flipped byte, same length
            txn.put(key(1), bytes(stored))
    tier = NvmeTier(config)
    assert tier.get_into(key(1), memoryview(bytearray(size))) is None
    assert tier.size_of(key(1)) is None
    assert tier.usage().checksum_failures == 1
    assert tier.usage().blocks == 1
    assert read(tier, key(2)) == payload(2, size)
    tier = reopen(tier, config)
    assert [b.key for b in tier.scan()] == [key(2)]  # the delete reached the disk
    tier.close()


def read_loop(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    """Batched reads through the C loop over plain blocks ("native", asserted built) or Python's."""
    import tiers.nvme_stored

    if loop == "python":
        monkeypatch.setattr(tiers.nvme_stored, "native", None)
    else:
        native_verify()


def three_blocks_stored(config: NvmeConfig, size: int) -> None:
    """Blocks 1-3 of ``size`` bytes committed in ``config``'s folder, the tier closed."""
    tier = NvmeTier(config)
    for i in (1, 2, 3):
        tier.put(key(i), payload(i, size), FP)
    tier.close()


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_batched_read_serves_committed_queued_missing_and_corrupt_blocks_in_one_transaction(
    config: NvmeConfig, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    import tiers.nvme_stored

    read_loop(monkeypatch, loop)
    starts: list[int] = []  # where each native run over the plain blocks began
    if loop == "native":
        read_plain = tiers.nvme_stored.native.read_plain

        def counted_run(*args: object) -> object:
            starts.append(cast(int, args[6]))
            return read_plain(*args)

        monkeypatch.setattr(tiers.nvme_stored.native, "read_plain", counted_run)
    size = 300_000
    three_blocks_stored(config, size)
    with raw_env(config) as env, env.begin(write=True, db=env.open_db(b"payloads")) as txn:
        stored = bytearray(txn.get(key(2)) or b"")
        stored[size // 2] ^= 0x01
        txn.put(key(2), bytes(stored))
    tier = NvmeTier(config)
    gate = WriterGate(tier, monkeypatch)
    tier.put(key(4), payload(4, size), FP)  # queued: the writer waits at the gate
    env = tier._env

    class Counted:  # the environment, counting the transactions its readers begin
        begins = 0

        def begin(self, **kwargs: object) -> object:
            Counted.begins += 1
            return env.begin(**kwargs)  # type: ignore[arg-type]

        def __getattr__(self, name: str) -> object:
            return getattr(env, name)

    monkeypatch.setattr(tier, "_env", Counted())
    outs = [bytearray(size) for _ in range(5)]
    sizes: list[int | None] = []
    tier.get_into_many([key(1), key(2), key(3), key(9), key(4)], [memoryview(o) for o in outs], sizes)
    assert sizes == [size, None, size, None, size]
    assert [bytes(outs[i]) for i in (0, 2, 4)] == [payload(i, size) for i in (1, 3, 4)]
    assert Counted.begins == 1
    # natively: blocks 1-3 in one run (2 corrupt), 9 (missing) and 4 (queued) left to the Python loop
    assert starts == ([0, 4] if loop == "native" else [])
    assert tier.usage().checksum_failures == 1 and tier.size_of(key(2)) is None
    gate.open()
    tier.close()


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_stored_value_of_another_length_than_its_header_is_a_counted_miss_never_copied(
    config: NvmeConfig, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    read_loop(monkeypatch, loop)
    size = 20_000
    three_blocks_stored(config, size)
    with raw_env(config) as env, env.begin(write=True, db=env.open_db(b"payloads")) as txn:
        txn.put(key(1), payload(1, size)[:-1])  # shorter than its header says
        txn.put(key(2), payload(2, size) + b"\0" * 64)  # longer: a reader trusting it would overrun
    tier = NvmeTier(config)
    outs = [bytearray(size) for _ in range(3)]
    sizes: list[int | None] = []
    tier.get_into_many([key(1), key(2), key(3)], [memoryview(o) for o in outs], sizes)
    assert sizes == [None, None, size]
    assert outs[0] == outs[1] == bytearray(size) and bytes(outs[2]) == payload(3, size)
    assert tier.usage().checksum_failures == 2 and tier.usage().blocks == 1
    tier.close()


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_batched_read_fills_typed_and_byte_buffers_alike(
    config: NvmeConfig, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """A restore's buffers may be views of any element type (a float16 page, a 2-D block of
    rows): each is filled byte for byte, as a flat byte buffer is."""
    read_loop(monkeypatch, loop)
    size = 20_000
    three_blocks_stored(config, size)
    tier = NvmeTier(config)
    halves = np.zeros(size // 2, dtype=np.float16)
    rows = np.zeros((10, size // 10), dtype=np.uint8)
    flat = bytearray(size)
    outs = [memoryview(halves), memoryview(rows), memoryview(flat)]
    sizes: list[int | None] = []
    tier.get_into_many([key(1), key(2), key(3)], outs, sizes)
    assert sizes == [size] * 3
    assert [halves.tobytes(), rows.tobytes(), bytes(flat)] == [payload(i, size) for i in (1, 2, 3)]
    tier.close()


def test_the_native_plain_loop_reads_through_the_transactions_own_database(config: NvmeConfig) -> None:
    native_verify()
    from tiers import _verify  # type: ignore[attr-defined]

    size = 5000
    three_blocks_stored(config, size)
    tier = NvmeTier(config)
    keys = [key(1), key(2), key(3)]
    entries = [tier._index.get(k) for k in keys]
    outs = [memoryview(bytearray(size)) for _ in keys]
    sizes: list[int | None] = []
    bad: list[int] = []
    with tier._env.begin(db=tier._payloads, buffers=True) as txn:  # get(key) reads the payloads
        done = _verify.read_plain(txn.get, keys, entries, [None] * 3, outs, Codec.NONE, 0, sizes, bad)
    assert (done, sizes, bad) == (3, [size] * 3, [])
    assert [bytes(o) for o in outs] == [payload(i, size) for i in (1, 2, 3)]
    tier.close()


def test_a_batched_read_stops_at_a_buffer_too_small_and_gives_its_readers_back(config: NvmeConfig) -> None:
    tier = NvmeTier(config)
    for i in (1, 2, 3):
        tier.put(key(i), payload(i, 5000), FP)
    tier.flush()
    outs = [bytearray(5000), bytearray(4999), bytearray(5000)]
    sizes: list[int | None] = []
    with pytest.raises(ValueError, match="4999 bytes, block needs 5000"):
        tier.get_into_many([key(1), key(2), key(3)], [memoryview(o) for o in outs], sizes)
    assert sizes == [5000] and bytes(outs[0]) == payload(1, 5000)
    assert outs[1] == bytearray(4999) and outs[2] == bytearray(5000)
    closed = threading.Thread(target=tier.close)
    closed.start()
    closed.join(10)
    assert not closed.is_alive(), "close() waits for a reader the batch never gave back"


def native_verify(way: str = "verified_copy") -> Callable[[memoryview, memoryview, int], bool]:
    """``tiers._verify``'s way for this CPU (``verified_copy``), or either of its two."""
    import tiers.nvme_stored

    assert tiers.nvme_stored.verified_copy is not verified_copy_py, (
        "tiers._verify is not built: no C compiler?"
    )
    from tiers import _verify  # type: ignore[attr-defined]

    assert tiers.nvme_stored.verified_copy is _verify.verified_copy
    return cast(Callable[[memoryview, memoryview, int], bool], getattr(_verify, way))


VERIFIERS: dict[str, Callable[[], Callable[[memoryview, memoryview, int], bool]]] = {
    "native": native_verify,
    "one_pass": lambda: native_verify("one_pass"),
    "two_pass": lambda: native_verify("two_pass"),
    "python": lambda: verified_copy_py,
}


@pytest.mark.parametrize("impl", VERIFIERS)
def test_verified_copy_checks_every_chunk_and_copies_only_a_good_single_chunk(impl: str) -> None:
    verified_copy = VERIFIERS[impl]()
    data = payload(3, 2 * VERIFY_CHUNK_BYTES + 1)
    good = xxhash.xxh3_64_intdigest(data)
    out = bytearray(len(data))
    assert verified_copy(memoryview(data), memoryview(out), good) and out == data
    for flip in (0, VERIFY_CHUNK_BYTES, len(data) - 1):  # first, a middle and the last chunk
        bad = bytearray(data)
        bad[flip] ^= 1
        assert not verified_copy(memoryview(bytes(bad)), memoryview(bytearray(len(data))), good)
    small = data[:1000]
    untouched = bytearray(1000)
    assert not verified_copy(memoryview(small), memoryview(untouched), good)
    if impl in ("python", "two_pass"):
        assert untouched == bytearray(1000)  # a failed single chunk is never copied


# Every length class XXH3-64 treats apart (0, 1-3, 4-8, 9-16, 17-128, 129-240, then whole 1 KiB
# blocks of 16 stripes, a last block of whole stripes and the bytes after them, a last block
# that ends on a stripe), a block shorter and longer than one_pass's prefetch distance (8 KiB)
# and two_pass's whole block (512 KiB) and piece (4 KiB), and the streamed stores (16 MiB on,
# into a 16-byte aligned destination; unaligned ones are not streamed).
DIGEST_SIZES = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 255, 256, 1023, 1024, 1025, 1088, 1089]
DIGEST_SIZES += [
    4095,
    4096,
    4097,
    8191,
    8193,
    65_600,
    256 * 1024,
    3 * 1024 * 1024 + 63,
    16 * 1024 * 1024 + 4097,
]


@pytest.mark.parametrize("way", ["one_pass", "two_pass"])
def test_the_native_verified_copy_agrees_with_xxhash_and_copies_every_byte(way: str) -> None:
    verified_copy = native_verify(way)
    rng = np.random.default_rng(5)
    for size in DIGEST_SIZES:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        digest = xxhash.xxh3_64_intdigest(data)
        for shift in (0, 1):  # a 16-byte aligned destination (numpy's are) and an odd one
            out = np.zeros(size + 1, dtype=np.uint8)
            assert verified_copy(memoryview(data), memoryview(out)[shift : shift + size], digest), (
                size,
                shift,
            )
            assert out[shift : shift + size].tobytes() == data, (size, shift)
        out = bytearray(size + 1)
        assert not verified_copy(memoryview(data), memoryview(out)[1:], digest ^ 1), size
        if size > 4096:  # a flip in the first piece, across a piece boundary, in the last byte
            for flip in (0, 4096, size - 1):
                bad = bytearray(data)
                bad[flip] ^= 0x80
                assert not verified_copy(memoryview(bytes(bad)), memoryview(out), digest), (size, flip)


def test_the_native_verified_copy_refuses_bad_arguments_before_copying() -> None:
    verified_copy = native_verify()
    data = b"x" * 100
    digest = xxhash.xxh3_64_intdigest(data)
    with pytest.raises(ValueError, match="destination"):
        verified_copy(memoryview(data), memoryview(bytearray(99)), digest)
    with pytest.raises(TypeError):
        verified_copy(memoryview(data), memoryview(bytes(100)), digest)  # read-only
    with pytest.raises(OverflowError):
        verified_copy(memoryview(data), memoryview(bytearray(100)), -1)
