"""HSTU attention over a paged pool read in place (``kernels.hstu_paged.hstu_paged_attention_pool``):
the Triton kernel (under TRITON_INTERPRET=1 on CPU) against the reference that gathers
per-sequence copies, on random ragged shapes with scattered slots, candidates, biases on and off,
fp32 and bf16 pools."""

from __future__ import annotations

import pytest
import torch

from genrec.kernels.hstu_paged import hstu_paged_attention, hstu_paged_attention_pool


def _case(seed: int, lengths: list[int], new: list[int], cands: list[int], heads: int, dq: int, dv: int,
          pool_dtype: torch.dtype) -> dict:
    """A pool of S slots (more than the tokens, shuffled), each sequence's tokens in scattered
    slots; queries: each sequence's last ``new`` tokens (the last ``cands`` of them candidates)."""
    g = torch.Generator().manual_seed(seed)
    b, longest = len(lengths), max(lengths)
    total = sum(lengths)
    s = total + 37
    perm = torch.randperm(s, generator=g)
    slots = torch.zeros(b, longest + 3, dtype=torch.int32)  # rows wider than the sequences (as req_to_token's)
    at = 0
    for i, n in enumerate(lengths):
        slots[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    k_pool = torch.randn(s, heads, dq, generator=g).to(pool_dtype)
    v_pool = torch.randn(s, heads, dv, generator=g).to(pool_dtype)
    slot_times = torch.randint(1_700_000_000, 1_700_900_000, (s,), generator=g)
    seq = torch.repeat_interleave(torch.arange(b), torch.tensor(new))
    index = torch.cat([torch.arange(n - m, n) for n, m in zip(lengths, new)])
    q = torch.randn(int(sum(new)), heads, dq, generator=g)
    qt = torch.randint(1_700_900_000, 1_701_000_000, (q.shape[0],), generator=g)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, slots=slots, seq=seq, index=index,
                lengths=torch.tensor(lengths), slot_times=slot_times, query_times=qt,
                hist_lengths=torch.tensor([n - c for n, c in zip(lengths, cands)]) if any(cands) else None,
                pos_weights=torch.randn(64, generator=g) * 0.5, time_weights=torch.randn(24, generator=g) * 0.5)


CASES = {
    "one-new-each": ([5, 1, 70, 130], [1, 1, 1, 1], [0, 0, 0, 0]),
    "ragged-new": ([9, 64, 65, 3], [3, 1, 6, 3], [0, 0, 0, 0]),
    "candidates": ([12, 40, 7], [4, 6, 3], [2, 5, 3]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("biases", ["both", "pos", "none"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "blocked"])
def test_in_place_reads_of_the_pool_equal_the_reference_gathers(name: str, biases: str, pool_dtype: torch.dtype,
                                                                backend: str) -> None:
    lengths, new, cands = CASES[name]
    c = _case(len(name) + len(biases), lengths, new, cands, heads=2, dq=16, dv=8, pool_dtype=pool_dtype)
    kw = dict(max_seq_len=64, alpha=0.25, pos_weights=c["pos_weights"] if biases != "none" else None,
              time_weights=c["time_weights"] if biases == "both" else None, slot_times=c["slot_times"],
              query_times=c["query_times"], hist_lengths=c["hist_lengths"])
    args = (c["q"], c["k_pool"], c["v_pool"], c["slots"], c["seq"], c["index"], c["lengths"])
    ref = hstu_paged_attention_pool(*args, backend="torch", **kw)
    got = hstu_paged_attention_pool(*args, backend=backend, key_block=16, **kw)  # (blocked: several key blocks)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_the_reference_is_the_dense_op_on_gathered_copies():
    lengths, new, cands = CASES["candidates"]
    c = _case(3, lengths, new, cands, heads=1, dq=16, dv=8, pool_dtype=torch.float32)
    rows = c["slots"][:, : max(lengths)].long()
    want = hstu_paged_attention(c["q"], c["k_pool"][rows], c["v_pool"][rows], c["seq"], c["index"], c["lengths"],
                                max_seq_len=64, alpha=0.25, pos_weights=c["pos_weights"],
                                time_weights=c["time_weights"], key_times=c["slot_times"][rows],
                                query_times=c["query_times"], hist_lengths=c["hist_lengths"])
    got = hstu_paged_attention_pool(c["q"], c["k_pool"], c["v_pool"], c["slots"], c["seq"], c["index"], c["lengths"],
                                    max_seq_len=64, alpha=0.25, pos_weights=c["pos_weights"],
                                    time_weights=c["time_weights"], slot_times=c["slot_times"],
                                    query_times=c["query_times"], hist_lengths=c["hist_lengths"], backend="torch")
    torch.testing.assert_close(got, want)


def test_time_bias_without_times_and_an_unknown_backend_are_refused():
    c = _case(0, [4], [1], [0], heads=1, dq=16, dv=8, pool_dtype=torch.float32)
    args = (c["q"], c["k_pool"], c["v_pool"], c["slots"], c["seq"], c["index"], c["lengths"])
    with pytest.raises(ValueError, match="slot_times"):
        hstu_paged_attention_pool(*args, max_seq_len=64, alpha=1.0, time_weights=c["time_weights"])
    with pytest.raises(ValueError, match="backend"):
        hstu_paged_attention_pool(*args, max_seq_len=64, alpha=1.0, backend="cuda")
