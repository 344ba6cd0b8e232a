"""The blocked candidate scorer (``kernels.hstu_candidates``) against the cached op's reference.

``tests/test_hstu_parity.py`` runs every backend with gradients recorded, where the blocked
backend hands over to the coded one; here it runs as it serves (inference mode), on random
shapes: users with empty histories, users without candidates, candidates in any order, blocks
that do not divide the candidates, one and two heads, fp32 (float rounding) and bf16.
"""

import pytest
import torch

from genrec.kernels import hstu_attention as ha
from genrec.kernels import hstu_candidates as hc
from genrec.kernels.hstu_candidates import block_rows, hstu_cached_attention_blocked
from genrec.kernels.jagged import lengths_to_offsets

N = 300  # max_seq_len


def case(seed: int, sorted_owner: bool = False) -> tuple:
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(2, 6, (1,), generator=g))
    lens = torch.randint(1, 90, (b,), generator=g)
    lens[int(torch.randint(0, b, (1,), generator=g))] = 0  # an empty history
    lens[int(torch.randint(0, b, (1,), generator=g))] = 257  # longer than a block of keys, odd
    heads, dqk, dv = 1 + seed % 2, (16, 24)[seed % 2], 8
    t = int(lens.sum())
    mk = lambda n, d: torch.randn(n, heads, d, generator=g) * 0.7  # noqa: E731
    kh, vh = mk(t, dqk), mk(t, dv)
    c = int(torch.randint(1, 150, (1,), generator=g))
    owner = torch.randint(0, b - 1, (c,), generator=g)  # the last user: no candidates
    if sorted_owner:
        owner = owner.sort().values
    q, k, v = mk(c, dqk), mk(c, dqk), mk(c, dv)
    times = torch.cumsum(torch.randint(0, 4000, (t,), generator=g), 0)
    terms = ("both", "position", "time", "none")[seed % 4]
    kw = dict(max_seq_len=N, alpha=dqk**-0.5,
              pos_weights=torch.randn(N, generator=g) if terms in ("both", "position") else None,
              time_weights=torch.randn(20, generator=g) if terms in ("both", "time") else None,
              hist_times=times, request_times=times.max() + torch.randint(0, 500, (b,), generator=g))
    return q, k, v, kh, vh, lengths_to_offsets(lens), owner, kw


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=rel * scale, rtol=0)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("block_elems", [1 << 20, 700])  # one block per user; blocks of 16 candidates
@pytest.mark.parametrize("sorted_owner", [False, True])
def test_blocked_matches_the_reference(seed, block_elems, sorted_owner):
    q, k, v, kh, vh, offsets, owner, kw = case(seed, sorted_owner)
    with torch.inference_mode():
        ref = ha.hstu_cached_attention_reference(q, k, v, kh, vh, offsets, owner, **kw)
        out = hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, block_elems=block_elems, **kw)
    close(out, ref, 1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fused", [True, False])
def test_blocked_bf16_within_its_rounding(seed, fused, monkeypatch):
    """bf16 GEMMs: within 2% of the output's scale of the fp32 reference, and far closer to it
    than an output with one bias term left out (what a wrong bias row reads); with oneDNN's
    fused SiLU epilogue and without it (the path of builds that lack it)."""
    if fused and hc._linear_pointwise is None:
        pytest.skip("this torch has no oneDNN linear_pointwise")
    if not fused:
        monkeypatch.setattr(hc, "_linear_pointwise", None)
    q, k, v, kh, vh, offsets, owner, kw = case(seed)
    with torch.inference_mode():
        ref = ha.hstu_cached_attention_reference(q, k, v, kh, vh, offsets, owner, **kw)
        out = ha.hstu_cached_attention(q, k, v, kh, vh, offsets, owner, backend="blocked", dtype=torch.bfloat16, **kw)
        assert out.dtype == torch.float32
        close(out, ref, 2e-2)
        if kw["pos_weights"] is not None:
            wrong = ha.hstu_cached_attention_reference(q, k, v, kh, vh, offsets, owner, **{**kw, "pos_weights": None})
            assert (wrong - ref).abs().max() > 5 * (out - ref).abs().max()


def test_auto_serves_through_the_blocks_and_shares_the_layout():
    """``auto`` without gradients runs the blocked scorer (its layout lands in the plan, for
    the next layer), with gradients the coded backend (whose backward exists)."""
    q, k, v, kh, vh, offsets, owner, kw = case(0)
    plan = ha.AttentionPlan()
    with torch.inference_mode():
        ha.hstu_cached_attention(q, k, v, kh, vh, offsets, owner, plan=plan, **kw)
    assert plan.blocked is not None and plan.groups is None
    plan = ha.AttentionPlan()
    qg = q.clone().requires_grad_()
    ha.hstu_cached_attention(qg, k, v, kh, vh, offsets, owner, plan=plan, **kw).sum().backward()
    assert plan.groups is not None and qg.grad is not None
    with pytest.raises(ValueError, match="needs 'blocked'"):
        ha.hstu_cached_attention(q, k, v, kh, vh, offsets, owner, backend="coded", dtype=torch.bfloat16, **kw)


def test_no_candidates_and_block_sizes():
    q, k, v, kh, vh, offsets, owner, kw = case(1)
    with torch.inference_mode():
        out = hstu_cached_attention_blocked(q[:0], k[:0], v[:0], kh, vh, offsets, owner[:0], **kw)
    assert out.shape == (0, *v.shape[1:])
    assert block_rows(4096) == 256 and block_rows(0) == 1 << 20 and block_rows(10**9) == 16


@pytest.mark.parametrize("terms", ["both", "position", "time", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_entries_read_the_table_without_building_it(terms, dtype):
    """``bias_entries`` gives ``bias_table(...)[code]`` bit for bit, the masked slot included."""
    from genrec.kernels.hstu_coded import bias_entries, bias_table

    g = torch.Generator().manual_seed(3)
    n, nb = 50, 7
    pos = torch.randn(n, generator=g) if terms in ("both", "position") else None
    tw = torch.randn(nb, generator=g) if terms in ("both", "time") else None
    slots = n * (nb if tw is not None else 1)
    code = torch.randint(0, slots + 1, (4, 33), generator=g, dtype=torch.int32)  # the last: masked
    code[0, 0] = slots
    want = bias_table(pos, tw, n, dtype)[code.long()]
    got = bias_entries(pos, tw, code, n, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_bf16_gemms_see_few_shapes_as_histories_and_candidates_vary(monkeypatch):
    """oneDNN builds a kernel per new GEMM shape (~1 ms): serving's calls, each with its own
    history length and candidate count, must reach it in a few bucketed shapes, with the same
    answers (zero keys, values and bias in the padding add nothing)."""
    shapes = set()
    mm = torch.mm

    def spy(a, b):  # noqa: ANN001, ANN202
        if a.dtype == torch.bfloat16:
            shapes.add((tuple(a.shape), tuple(b.shape)))
        return mm(a, b)

    monkeypatch.setattr(hc.torch, "mm", spy)
    g = torch.Generator().manual_seed(5)
    for n, c in zip(range(600, 640, 3), range(100, 140, 3)):
        kh, vh = torch.randn(n, 1, 16, generator=g), torch.randn(n, 1, 8, generator=g)
        q, k, v = torch.randn(c, 1, 16, generator=g), torch.randn(c, 1, 16, generator=g), torch.randn(c, 1, 8, generator=g)
        kw = dict(max_seq_len=N, alpha=0.25, pos_weights=torch.randn(N, generator=g))
        offsets, owner = torch.tensor([0, n]), torch.zeros(c, dtype=torch.long)
        with torch.inference_mode():
            got = hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, dtype=torch.bfloat16, **kw)
            want = hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, **kw)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert 0 < len(shapes) <= 4, sorted(shapes)  # (the second GEMM's: [candidates, keys] x [keys, Dv])
    assert hc.bucket(636) == 640 and hc.bucket(8000) == 8192 and hc.bucket(100) == 112
