"""What the SGLang engine's two sides exchange, without an engine: the answer rows (int64
catalogue positions past 2^24 exact) and the event token ids (SipHash-2-4 under a per-engine key)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genrec.serve.sglang_engine import event_token_ids, siphash24_words
from genrec.serve.sglang_models.codec import (
    EVENTS,
    FAILED,
    OK,
    decode_row,
    encode_row,
    failed_row,
    pack_events,
    pack_ints,
    stack_rows,
    unpack_events,
    unpack_ints,
)


def test_payload_arrays_travel_as_int64_bytes_and_come_back_whole():
    """A request's history and candidates go to the scheduler as raw int64 bytes (SGLang pickles
    each request: lists of 8,000 events cost ~3.5 ms a call there and back)."""
    rng = np.random.default_rng(0)
    cols = [rng.integers(0, 1 << 40, 9) for _ in EVENTS]
    cols[2][0] = (1 << 62) + 3  # times and item rows past int32 / float64's exact range stay exact
    data = pack_events(*cols)
    assert isinstance(data, bytes)
    np.testing.assert_array_equal(unpack_events(data), np.stack(cols))
    assert unpack_events(pack_events(*[np.zeros(0, np.int64)] * 4)).shape == (4, 0)
    cands = np.array([5, (1 << 24) + 1, (1 << 48) - 1], np.int64)
    assert isinstance(pack_ints(cands), bytes) and unpack_ints(pack_ints(cands)).tolist() == cands.tolist()
    assert pack_ints(None) is None and unpack_ints(None) is None


def test_rows_carry_int64_positions_past_2_pow_24_exactly():
    pos = torch.tensor([0, 1, (1 << 24) - 1, 1 << 24, (1 << 24) + 1, 16_777_217 * 3, (1 << 40) + 12345, (1 << 48) - 1])
    assert float(torch.tensor((1 << 24) + 1, dtype=torch.float32)) != (1 << 24) + 1  # what a float32 row loses
    scores = torch.linspace(-1, 1, pos.numel())
    probs = torch.rand(3, 2)
    a = decode_row(encode_row(pos, scores, probs, computed=7).numpy(), tasks=2)
    np.testing.assert_array_equal(a.positions, pos.numpy())
    assert a.positions.dtype == np.int64 and a.computed == 7 and a.status == OK
    np.testing.assert_array_equal(a.scores, scores.numpy())
    np.testing.assert_array_equal(a.probs, probs.numpy())


def test_rows_carry_the_beams_items_and_log_probabilities():
    """The semantic-ID beam's items travel beside the dense top-k (their positions as exact as
    the dense ones) and the task probabilities of what was ranked; a row without one reads empty."""
    pos, scores = torch.tensor([3, (1 << 24) + 1]), torch.tensor([0.25, -0.5])
    gen, logp = torch.tensor([(1 << 24) + 3, 0, (1 << 47) + 9]), torch.tensor([-0.1, -1.25, -7.0])
    probs = torch.rand(4, 3)
    a = decode_row(encode_row(pos, scores, probs, 9, generated=(gen, logp)).numpy(), tasks=3)
    np.testing.assert_array_equal(a.positions, pos.numpy())
    np.testing.assert_array_equal(a.scores, scores.numpy())
    np.testing.assert_array_equal(a.gen_positions, gen.numpy())
    np.testing.assert_array_equal(a.gen_scores, logp.numpy())
    np.testing.assert_array_equal(a.probs, probs.numpy())
    b = decode_row(encode_row(pos, scores, probs, 9).numpy(), tasks=3)
    assert b.gen_positions.size == 0 and b.gen_scores.size == 0 and b.probs.shape == (4, 3)


def test_padded_rows_and_failed_rows_decode():
    rows = [encode_row(torch.tensor([5]), torch.tensor([0.5]), torch.zeros(0, 1), 1),
            encode_row(torch.arange(4) + (1 << 30), torch.ones(4), torch.ones(4, 1), 3), failed_row(2)]
    batch = stack_rows(rows).numpy()  # zero padded to the longest row
    assert batch.shape[0] == 3
    first, second, third = (decode_row(r, tasks=1) for r in batch)
    assert first.positions.tolist() == [5] and first.probs.shape == (0, 1)
    assert second.positions.tolist() == [(1 << 30) + i for i in range(4)] and second.probs.shape == (4, 1)
    assert third.status == FAILED and third.computed == 2 and third.positions.size == 0


# ----- SipHash-2-4: a plain scalar version, checked against the paper's test vector ------------
M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & M64


def siphash24_bytes(key: bytes, msg: bytes) -> int:
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rounds(n: int) -> None:
        for _ in range(n):
            v[0] = (v[0] + v[1]) & M64; v[1] = _rotl(v[1], 13) ^ v[0]; v[0] = _rotl(v[0], 32)  # noqa: E702
            v[2] = (v[2] + v[3]) & M64; v[3] = _rotl(v[3], 16) ^ v[2]  # noqa: E702
            v[0] = (v[0] + v[3]) & M64; v[3] = _rotl(v[3], 21) ^ v[0]  # noqa: E702
            v[2] = (v[2] + v[1]) & M64; v[1] = _rotl(v[1], 17) ^ v[2]; v[2] = _rotl(v[2], 32)  # noqa: E702

    full = len(msg) - len(msg) % 8
    for i in range(0, full, 8):
        m = int.from_bytes(msg[i : i + 8], "little")
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    b = ((len(msg) & 0xFF) << 56) | int.from_bytes(msg[full:], "little")
    v[3] ^= b
    rounds(2)
    v[0] ^= b
    v[2] ^= 0xFF
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def test_the_scalar_siphash_matches_the_papers_vector():
    # SipHash paper, appendix A: key 00..0f, message 00..0e
    assert siphash24_bytes(bytes(range(16)), bytes(range(15))) == 0xA129CA6149BE45E5


def test_event_ids_are_siphash_of_the_events_under_the_engines_key():
    rng = np.random.default_rng(0)
    key = rng.bytes(16)
    cols = [rng.integers(-(1 << 62), 1 << 62, 50) for _ in range(4)]
    got = siphash24_words(key, cols)
    for i in range(50):
        msg = b"".join(int(c[i]).to_bytes(8, "little", signed=True) for c in cols)
        assert int(got[i]) == siphash24_bytes(key, msg)
    ids = event_token_ids(key, *cols)
    assert ids.dtype == np.int64 and (ids >= 0).all()  # 63 bits: a valid token id
    # the same events under another engine's key: other ids (nobody can aim at a user's entry)
    assert not np.array_equal(ids, event_token_ids(rng.bytes(16), *cols))
    # equal events, equal ids; one field changed, another id
    again = event_token_ids(key, *(c.copy() for c in cols))
    np.testing.assert_array_equal(ids, again)
    moved = [c.copy() for c in cols]
    moved[2][3] += 1
    assert (event_token_ids(key, *moved) != ids).sum() == 1


def test_native_event_ids_are_the_numpy_siphash(monkeypatch):
    from genrec.kernels import hstu_native

    if hstu_native.library() is None:
        pytest.skip("the native kernels did not build")
    rng = np.random.default_rng(1)
    key = rng.bytes(16)
    for n in (0, 1, 7, 4096):
        cols = [rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64) for _ in range(4)]
        cols[1] = cols[1][::-1]  # a strided view is read as its values
        want = (siphash24_words(key, cols) >> np.uint64(1)).astype(np.int64)
        np.testing.assert_array_equal(event_token_ids(key, *cols), want)
    monkeypatch.setattr(hstu_native, "library", lambda: None)  # without the library: NumPy's, the same ids
    np.testing.assert_array_equal(event_token_ids(key, *cols), want)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="differ in length"):
        event_token_ids(key, cols[0], cols[1][:3], cols[2], cols[3])


def test_siphash_refuses_a_short_key():
    with pytest.raises(ValueError, match="16-byte"):
        siphash24_words(b"short", [np.zeros(1, np.int64)])
    with pytest.raises(ValueError, match="16-byte"):
        event_token_ids(b"short", *[np.zeros(1, np.int64)] * 4)
