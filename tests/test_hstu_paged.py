"""Incremental HSTU encoding (``HSTUTower.extend_paged``, ``kernels.hstu_paged``) against one
full pass: new tokens over cached keys / values give what the whole sequence gives them."""

from __future__ import annotations

import pytest
import torch

from genrec.kernels.jagged import lengths_to_offsets
from genrec.models.hstu import HSTUConfig, HSTUTower, JaggedMeta, PagedMeta


def _tower(heads: int, time_bias: bool = True) -> HSTUTower:
    torch.manual_seed(0)
    cfg = HSTUConfig(num_layers=2, num_heads=heads, qk_dim=16, v_dim=8, dropout=0.0, time_bias=time_bias)
    t = HSTUTower(cfg, 24, max_seq_len=64).eval()
    for la in t.layers:  # visible biases
        torch.nn.init.normal_(la.pos_weights, std=0.5)
        if la.time_weights is not None:
            torch.nn.init.normal_(la.time_weights, std=0.5)
    return t


def _batch(hist: list[int], cands: list[int], seed: int) -> tuple[torch.Tensor, JaggedMeta]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([h + c for h, c in zip(hist, cands)])
    n = int(lengths.sum())
    times, qtimes = [], []
    for h, c in zip(hist, cands):
        t = torch.cumsum(torch.randint(1, 5000, (h,), generator=g), 0) + 1_700_000_000
        req = int(t[-1]) + 100
        times.append(torch.cat([t, torch.full((c,), req)]))
        qtimes.append(torch.cat([t[1:], torch.tensor([req]), torch.full((c,), req)]))
    meta = JaggedMeta(lengths_to_offsets(lengths), int(lengths.max()), torch.cat(times), torch.cat(qtimes),
                      torch.tensor(cands) if any(cands) else None)
    return torch.randn(n, 24, generator=g), meta


@pytest.mark.parametrize("heads,time_bias", [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("with_candidates", [False, True])
@pytest.mark.parametrize("layout", ["padded", "pool"])
def test_new_tokens_over_cached_prefix_match_one_full_pass(heads: int, time_bias: bool, with_candidates: bool,
                                                           layout: str) -> None:
    """``layout`` "pool": the cache is one paged pool [S, H, D] with scattered slots, read in
    place through ``PagedMeta.slots`` (SGLang's layout; the blocked CPU path), "padded": [B, L, H, D]."""
    tower = _tower(heads, time_bias)
    hist = [7, 1, 40, 300]
    cands = [3, 5, 0, 2] if with_candidates else [0, 0, 0, 0]
    x, meta = _batch(hist, cands, seed=heads)
    if not time_bias:
        meta.timestamps = meta.query_times = None
    with torch.no_grad():
        layers: list = []
        full = tower(x, meta, cache=layers)
        cached = [0, 0, 33, 299]  # history tokens already in the cache per sequence (0: cold)
        lengths = torch.tensor([h + c for h, c in zip(hist, cands)])
        off = meta.offsets
        new_rows = torch.cat([torch.arange(int(off[b]) + cached[b], int(off[b + 1])) for b in range(len(hist))])
        seq = torch.repeat_interleave(torch.arange(len(hist)), lengths - torch.tensor(cached))
        index = new_rows - off[seq]
        b, big = len(hist), int(lengths.max())
        pools = []
        for k, v in layers:  # the cache holds the full pass's keys / values of the cached tokens only
            kp, vp = k.new_zeros(b, big, *k.shape[1:]), v.new_zeros(b, big, *v.shape[1:])
            for s in range(b):
                kp[s, : cached[s]] = k[int(off[s]) : int(off[s]) + cached[s]]
                vp[s, : cached[s]] = v[int(off[s]) : int(off[s]) + cached[s]]
            pools.append((kp, vp))

        def store(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kp, vp = pools[i]
            kp[seq, index], vp[seq, index] = k, v
            return kp, vp

        key_times = None
        if time_bias:
            key_times = torch.zeros(b, big, dtype=torch.int64)
            for s in range(b):
                key_times[s, : int(lengths[s])] = meta.timestamps[int(off[s]) : int(off[s + 1])]
        pm = PagedMeta(seq, index, lengths, key_times, meta.query_times[new_rows] if time_bias else None,
                       torch.tensor(hist) if with_candidates else None)
        if layout == "pool":  # the same cache scattered over a pool's slots, read through the slot map
            slots = torch.randperm(b * big + 11, generator=torch.Generator().manual_seed(5))[: b * big].view(b, big)
            flat = [(kp.new_zeros(b * big + 11, *kp.shape[2:]), vp.new_zeros(b * big + 11, *vp.shape[2:]))
                    for kp, vp in pools]
            for (kf, vf), (kp, vp) in zip(flat, pools):
                kf[slots], vf[slots] = kp, vp
            slot_times = torch.zeros(b * big + 11, dtype=torch.int64)
            if key_times is not None:
                slot_times[slots] = key_times

            def store(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: F811
                kf, vf = flat[i]
                kf[slots[seq, index]], vf[slots[seq, index]] = k, v
                return kf, vf

            pm = PagedMeta(seq, index, lengths, None, pm.query_times, pm.hist_lengths, slots=slots.to(torch.int32),
                           slot_times=slot_times if time_bias else None)
        out = tower.extend_paged(x[new_rows], pm, store)
    torch.testing.assert_close(out, full[new_rows], atol=1e-5, rtol=1e-5)


def test_query_blocks_and_empty_calls() -> None:
    """Long runs of new tokens go through the query blocks; no new token: an empty result."""
    from genrec.kernels.hstu_paged import hstu_paged_attention

    torch.manual_seed(1)
    q, k, v = torch.randn(10, 1, 4), torch.randn(1, 10, 1, 4), torch.randn(1, 10, 1, 4)
    seq, idx = torch.zeros(10, dtype=torch.int64), torch.arange(10)
    kw = dict(max_seq_len=16, alpha=0.5, pos_weights=torch.randn(16))
    one = hstu_paged_attention(q, k, v, seq, idx, torch.tensor([10]), **kw)
    blocked = hstu_paged_attention(q, k, v, seq, idx, torch.tensor([10]), query_block=3, **kw)
    torch.testing.assert_close(one, blocked)
    empty = hstu_paged_attention(q[:0], k, v, seq[:0], idx[:0], torch.tensor([10]), **kw)
    assert empty.shape == (0, 1, 4)
