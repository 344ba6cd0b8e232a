"""bf16 inference ops (``kernels.bf16_ops``): the native SiLU pass against PyTorch's over every
bf16 value, the bf16 linear, and the paths that use them (the candidates' attention blocks, the
tower's linear layers, the ranking head) against fp32."""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from genrec.kernels import bf16_ops, native
from genrec.kernels import hstu_candidates as hc
from genrec.models.ranking import RankingConfig, RankingHead, TaskConfig


def _pass() -> ctypes._CFuncPtr:
    lib = native.library("bf16_ops")
    if lib is None:
        pytest.skip("no C++ compiler here (kernels.native)")
    f = lib.genrec_silu_bf16
    f.argtypes, f.restype = [ctypes.c_int64, ctypes.c_void_p], ctypes.c_int
    return f


def every_bf16() -> torch.Tensor:
    """Every finite bf16 value, both signs, zeros and subnormals included."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x)].clone()


def test_the_native_silu_is_within_a_bf16_ulp_of_pytorch_on_every_value():
    """Either build (16 lanes or one): each output within one bf16 ulp of fp32 SiLU rounded to
    bf16, 99% of them equal; an output PyTorch gives as a bf16 subnormal (|y| < 1.2e-38) may
    come out as zero (the hardware's conversion flushes them). Lengths that leave tails after
    the 64- and 16-value steps, in place."""
    f = _pass()
    x = every_bf16()
    want = F.silu(x.float()).bfloat16().float()
    got = x.clone()
    assert f(got.numel(), got.data_ptr()) == 0
    got = got.float()
    normal = want.abs() >= 1.2e-38
    ulp = want.abs() * 2**-7
    assert ((got - want).abs() <= ulp)[normal].all()
    assert (got[~normal].abs() <= 1.2e-38).all()
    assert (got == want).float().mean() > 0.99
    for n in (1, 15, 17, 63, 65, 130):
        y = x[1000 : 1000 + n].clone()
        tail = x[1000 + n : 1000 + n + 8].clone()
        f(n, y.data_ptr())
        assert torch.equal(y, F.silu(x[1000 : 1000 + n].float()).bfloat16()) or (
            (y.float() - F.silu(x[1000 : 1000 + n].float())).abs().max() < 0.01)
        assert torch.equal(x[1000 + n : 1000 + n + 8], tail)  # nothing written past n


def test_silu_falls_back_to_pytorch_off_its_layout():
    """fp32, non-contiguous or where the pass is not built: PyTorch's SiLU, in place."""
    x = torch.randn(8, 6)
    want = F.silu(x)
    assert torch.equal(bf16_ops.silu_(x), want)
    y = torch.randn(6, 8).bfloat16().T
    want = F.silu(y.float()).bfloat16()
    torch.testing.assert_close(bf16_ops.silu_(y).float(), want.float(), atol=0.02, rtol=0.01)


def test_linear_in_bf16_is_fp32s_to_its_rounding():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(300, 64, generator=g), torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, generator=g)
    for silu in (False, True):
        got = bf16_ops.linear(x, w, b, silu=silu)
        want = F.linear(x, w, b)
        want = F.silu(want) if silu else want
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


def test_the_candidates_blocks_take_the_native_silu_where_it_is_built(monkeypatch):
    """bf16 candidates on a CPU where the pass is vectorised: every score block goes through it
    (not oneDNN's SiLU epilogue), with the answers of fp32 to bf16's rounding."""
    if hc._linear_pointwise is None or not bf16_ops.fast_silu():
        pytest.skip("the native bf16 pass is not vectorised for this CPU, or no oneDNN linear")
    seen = []
    orig = bf16_ops.silu_
    monkeypatch.setattr(bf16_ops, "silu_", lambda t: (seen.append(tuple(t.shape)), orig(t))[1])
    g = torch.Generator().manual_seed(1)
    n, c = 700, 300
    kh, vh = torch.randn(n, 1, 16, generator=g), torch.randn(n, 1, 8, generator=g)
    q, k, v = (torch.randn(c, 1, d, generator=g) for d in (16, 16, 8))
    kw = dict(max_seq_len=1000, alpha=0.25, pos_weights=torch.randn(1000, generator=g) * 0.1)
    offsets, owner = torch.tensor([0, n]), torch.zeros(c, dtype=torch.long)
    with torch.inference_mode():
        got = hc.hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, dtype=torch.bfloat16, **kw)
        want = hc.hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, **kw)
    assert seen and all(s[1] == hc.bucket(n) for s in seen)
    torch.testing.assert_close(got, want, atol=2e-2 * float(want.abs().max()), rtol=0)


def _attention_fp32(q, k, v, bias, own_k, own_v, alpha, own_bias, scale):  # noqa: ANN001, ANN202
    s = alpha * q @ k.T + bias
    own = F.silu(alpha * (q * own_k).sum(-1) + own_bias)
    return scale * (F.silu(s) @ v + own[:, None] * own_v)


@pytest.mark.parametrize("c,n,d,dv", [(2000, 1100, 64, 64), (13, 100, 24, 16), (7, 1, 64, 32), (301, 777, 64, 128),
                                      (5, 0, 64, 64), (17, 33, 2, 16), (9, 65, 34, 32)])
def test_the_native_candidates_attention_is_fp32s_to_bf16_rounding(c, n, d, dv):
    """``candidate_attention`` (scores, SiLU, value GEMM, own term, scale in one pass) against
    the fp32 formula: within bf16's rounding (0.6% of the output's scale), on shapes whose
    candidates fill no block of 6 (or 2) rows, whose keys fill no tile of 16 or 64, with dims
    that are not a multiple of 16, an empty history, and rows read strided (one head of two)."""
    if not bf16_ops.fused_candidates(d, dv):
        pytest.skip("no native candidates' attention on this CPU (AVX512-BF16)")
    g = torch.Generator().manual_seed(c + n)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, own_k, own_v = mk(c, 2, d)[:, 1] * 0.2, mk(c, 2, d)[:, 0], mk(c, 2, dv)[:, 1]
    k, v, bias = mk(n, 2, d)[:, 0], mk(n, 2, dv)[:, 1], mk(n) * 0.3
    out = torch.full((c, 2, dv), float("nan"))[:, 0]
    got = bf16_ops.candidate_attention(q, k, v, bias, own_k, own_v, 0.7, 0.1, 1 / 300, out)
    want = _attention_fp32(q, k, v, bias, own_k, own_v, 0.7, 0.1, 1 / 300)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=6e-3 * scale, rtol=0)
    far = _attention_fp32(q, k, v, bias * 0, own_k, own_v, 0.7, 0.1, 1 / 300)  # the bias left out
    if n > 1:
        assert (far - want).abs().max() > 5 * (got - want).abs().max()


def test_the_native_candidates_attention_splits_its_blocks_between_threads_exactly():
    """Enough candidates for the pass to share its row blocks between PyTorch's threads: the
    same answers bit for bit with one thread and with two (each block is one thread's)."""
    if not bf16_ops.fused_candidates(64, 64):
        pytest.skip("no native candidates' attention on this CPU (AVX512-BF16)")
    g = torch.Generator().manual_seed(4)
    c, n = 203, 300
    q, own_k, k = (torch.randn(m, 64, generator=g) for m in (c, c, n))
    own_v, v, bias = torch.randn(c, 64, generator=g), torch.randn(n, 64, generator=g), torch.randn(n, generator=g)
    threads, outs = torch.get_num_threads(), []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(bf16_ops.candidate_attention(q, k, v, bias, own_k, own_v, 0.125, 0.0, 0.01, torch.empty(c, 64)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_the_bf16_candidates_take_the_native_attention_where_it_is_built(monkeypatch):
    """The blocked scorer in bf16 with heads the kernel covers: every (user, head) through
    ``candidate_attention``, none through the two-GEMM blocks, the answers of fp32 to bf16's
    rounding: two heads, users in any order, one with an empty history."""
    if hc._linear_pointwise is None or not bf16_ops.fused_candidates(16, 16):
        pytest.skip("no native candidates' attention on this CPU, or no oneDNN linear")
    calls, gemms = [], []
    orig = bf16_ops.candidate_attention
    monkeypatch.setattr(bf16_ops, "candidate_attention", lambda *a: (calls.append(a[0].shape), orig(*a))[1])
    monkeypatch.setattr(hc, "_linear_pointwise", lambda *a: gemms.append(1))
    g = torch.Generator().manual_seed(2)
    lens = torch.tensor([700, 0, 90])
    t, c = int(lens.sum()), 400
    kh, vh = torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g)
    q, k, v = (torch.randn(c, 2, 16, generator=g) for _ in range(3))
    owner = torch.randint(0, 3, (c,), generator=g)
    kw = dict(max_seq_len=1000, alpha=0.25, pos_weights=torch.randn(1000, generator=g) * 0.1,
              time_weights=torch.randn(8, generator=g) * 0.1, hist_times=torch.arange(t) * 50,
              request_times=torch.tensor([40_000, 40_000, 40_000]))
    offsets = torch.tensor([0, 700, 700, t])
    with torch.inference_mode():
        got = hc.hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, dtype=torch.bfloat16, **kw)
        want = hc.hstu_cached_attention_blocked(q, k, v, kh, vh, offsets, owner, **kw)
    assert len(calls) == 2 * 3 and not gemms
    torch.testing.assert_close(got, want, atol=1e-2 * float(want.abs().max()), rtol=0)


def test_the_ranking_head_in_bf16_is_fp32s_to_its_rounding():
    """``RankingHead(dtype=bf16)``: the MLP's GEMMs and SiLUs in bf16 (what a bf16 call scores
    with), logits within bf16's rounding of fp32's and far closer than another head's."""
    torch.manual_seed(0)
    cfg = RankingConfig(tasks=(TaskConfig("click", ("click",)), TaskConfig("buy", ("buy",))), hidden=(64, 32))
    head, other = RankingHead(cfg, 16, 8).eval(), RankingHead(cfg, 16, 8).eval()
    h, items, ctx = torch.randn(500, 16), torch.randn(500, 16), torch.randn(500, 8)
    with torch.inference_mode():
        want = head(h, items, ctx)
        got = head(h, items, ctx, torch.bfloat16)
        far = other(h, items, ctx)
    assert got.dtype == torch.float32
    err = (got - want).abs().max()
    assert err < 0.02 * float(want.abs().max()) and err < 0.1 * float((far - want).abs().max())


def test_linear_reaches_onednn_in_few_row_counts_with_the_same_answers(monkeypatch):
    """oneDNN builds a kernel per new bf16 GEMM shape (~1 ms; its cache holds 1,024): the
    candidates' linear layers and head see each call's own candidate count, so their rows are
    padded to a few sizes, and the padding changes nothing."""
    if bf16_ops.linear_pointwise is None:
        pytest.skip("this torch has no oneDNN linear_pointwise")
    shapes = set()
    orig = bf16_ops.linear_pointwise

    def spy(x, *a):  # noqa: ANN001, ANN002, ANN202
        shapes.add(tuple(x.shape))
        return orig(x, *a)

    monkeypatch.setattr(bf16_ops, "linear_pointwise", spy)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(32, 16, generator=g), torch.randn(32, generator=g)
    for n in range(200, 260, 3):
        x = torch.randn(n, 16, generator=g)
        got = bf16_ops.linear(x, w, b, silu=True)
        assert got.shape == (n, 32)
        torch.testing.assert_close(got.float(), F.silu(F.linear(x, w, b)), atol=0.05, rtol=0.02)
    assert len(shapes) <= 5, sorted(shapes)  # (20 row counts)


def test_silu_trains_through_the_native_passes_within_a_bf16_ulp():
    """``bf16_ops.silu``'s backward against fp32 SiLU's derivative rounded to bf16, on every
    bf16 value: within one ulp where the result is normal (the vectorised build)."""
    if not bf16_ops.fast_silu():
        pytest.skip("the SiLU pass is not vectorised on this CPU")
    x = every_bf16().requires_grad_()
    y = bf16_ops.silu(x)
    assert type(y.grad_fn).__name__ == "_SiluBackward"
    y.backward(torch.ones_like(y))
    xf = x.detach().float().requires_grad_()
    F.silu(xf).backward(torch.ones_like(xf))
    want = xf.grad.bfloat16().float()
    got = x.grad.float()
    normal = want.abs() > 1.2e-38
    ulp = want.abs() * 2**-7
    assert ((got - want).abs()[normal] <= ulp[normal]).all()
    assert (got == want).float().mean() > 0.99


def test_the_hstu_layers_take_the_native_silu_under_bf16_autocast():
    # PyTorch's bf16 SiLU and its backward ran at about a fifth of the native passes' rate
    from genrec.models.hstu import HSTUConfig, HSTULayer

    if not bf16_ops.fast_silu():
        pytest.skip("the SiLU pass is not vectorised on this CPU")
    layer = HSTULayer(HSTUConfig(num_layers=1), 32, 16).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        u, *_ = layer._split(torch.randn(7, 32))
    assert type(u.grad_fn.next_functions[0][0]).__name__ == "_SiluBackward"


def test_the_training_silu_writes_its_output_in_one_pass():
    # the forward once cloned x and ran the in-place pass over the clone: a second read and
    # write of the layer's [T, 4 x 128] projection every layer of every step
    from torch.profiler import profile

    if not bf16_ops.fast_silu():
        pytest.skip("the SiLU pass is not vectorised on this CPU")
    x = (torch.randn(300, 70) * 4).bfloat16().requires_grad_()
    before = x.detach().clone()
    with profile() as prof:
        y = bf16_ops.silu(x)
    assert not {"aten::clone", "aten::copy_"} & {e.name for e in prof.events()}
    assert torch.equal(x.detach(), before)  # kept for the backward
    assert torch.equal(y.detach(), bf16_ops.silu_(before.clone()))
