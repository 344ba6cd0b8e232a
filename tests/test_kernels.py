"""Triton HSTU attention vs the PyTorch reference, run on CPU by the Triton interpreter.

Random jagged shapes include zero-length sequences, lengths not divisible by the block,
several head counts and dims, with and without targets and biases; forward and every
gradient (q, k, v, both bias tables) are compared, with per-dtype tolerances.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is imported

from genrec.kernels.hstu_attention import hstu_attention, hstu_attention_reference  # noqa: E402
from genrec.kernels.jagged import lengths_to_offsets  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def case(lengths, heads, dqk, dv, dtype, targets, bias, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    t = int(lens.sum())
    mk = lambda d: (torch.randn(t, heads, d, generator=g) * 0.5).to(DEVICE, dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(dqk), mk(dqk), mk(dv)
    kw = dict(max_seq_len=64, alpha=dqk**-0.5)
    if bias:
        kw["pos_weights"] = torch.randn(64, generator=g).to(DEVICE).requires_grad_()
        kw["time_weights"] = torch.randn(24, generator=g).to(DEVICE).requires_grad_()
        ts = torch.cumsum(torch.randint(0, 3000, (t,), generator=g), 0)
        kw["timestamps"], kw["query_times"] = ts.to(DEVICE), (ts + torch.randint(0, 90, (t,), generator=g)).to(DEVICE)
    if targets:
        kw["num_targets"] = torch.tensor([min(n, (i % 3) + (n > 1)) for i, n in enumerate(lengths)]).to(DEVICE)
    return q, k, v, lengths_to_offsets(lens).to(DEVICE), kw


CASES = [
    # lengths, heads, dqk, dv, targets, bias
    ([5, 0, 37, 16, 1], 2, 16, 16, False, True),
    ([33, 7, 0], 1, 32, 16, True, True),
    ([1, 2, 3, 50], 4, 16, 32, True, False),
    ([64, 17], 2, 64, 64, False, False),
    ([0, 0, 9], 1, 16, 16, True, True),
]


@pytest.mark.parametrize("backend", ["triton", "auto"])  # auto on CPU: the coded path (training's)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths,heads,dqk,dv,targets,bias", CASES)
def test_fast_paths_match_reference_forward_and_backward(lengths, heads, dqk, dv, targets, bias, dtype, backend):
    q, k, v, offsets, kw = case(lengths, heads, dqk, dv, dtype, targets, bias, seed=len(lengths) + heads)
    out = hstu_attention(q, k, v, offsets, backend=backend, **kw)
    # the reference in fp32 is the ground truth for every dtype
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = hstu_attention_reference(q32, k32, v32, offsets, **kw)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    grad = torch.randn_like(ref)
    leaves = [q, k, v] + [kw[n] for n in ("pos_weights", "time_weights") if n in kw]
    ref_leaves = [q32, k32, v32] + [kw[n] for n in ("pos_weights", "time_weights") if n in kw]
    got = torch.autograd.grad(out, leaves, grad.to(dtype))
    want = torch.autograd.grad(ref, ref_leaves, grad)
    scale = max(1.0, sum(lengths) / 16)  # bias-table grads sum over many pairs
    for name, a, b in zip(["q", "k", "v", "pos", "time"], got, want):
        torch.testing.assert_close(a.float(), b, atol=atol * (scale if name in ("pos", "time") else 1) * 4,
                                   rtol=rtol * 4, msg=lambda m, n=name: f"grad {n}: {m}")


def test_the_flop_count_sees_the_triton_attention():
    # a Triton launch dispatches no aten op: the kernel reports its causal-triangle work itself
    from genrec.train.observe.stepstats import FlopCount

    lengths = [5, 0, 37, 16, 1]
    q, k, v, offsets, kw = case(lengths, 2, 16, 32, torch.float32, False, True, seed=0)
    count = FlopCount()
    out = hstu_attention(q, k, v, offsets, backend="triton", **kw)
    forward = count.finish()
    assert forward == sum(n * (n + 1) // 2 for n in lengths) * 2 * 2 * (16 + 32)
    count = FlopCount()
    out.sum().backward()
    assert count.finish() == 2 * forward


def test_auto_backend_on_cpu_matches_the_reference_and_refuses_bad_head_dims():
    q, k, v, offsets, kw = case([3, 4], 1, 8, 8, torch.float32, False, True, 0)
    out = hstu_attention(q, k, v, offsets, backend="auto", **kw)
    torch.testing.assert_close(out, hstu_attention_reference(q, k, v, offsets, **kw))
    with pytest.raises(ValueError, match="power-of-two qk head dim"):
        hstu_attention(q, k, v, offsets, backend="triton", **kw)
    with pytest.raises(ValueError, match="unknown attention backend"):
        hstu_attention(q, k, v, offsets, backend="cuda", **kw)


@pytest.mark.parametrize("t,n,d,chunk", [(37, 11, 8, 5), (100, 50, 16, None), (5, 300, 4, 1000), (1, 3, 2, None)])
def test_chunked_softmax_cross_entropy_matches_the_unfused_loss(t, n, d, chunk):
    from genrec.kernels.softmax_ce import softmax_cross_entropy

    g = torch.Generator().manual_seed(t * n)
    u = torch.randn(t, d, generator=g, dtype=torch.float64)
    it = torch.randn(n, d, generator=g, dtype=torch.float64)
    idx = torch.randint(n, (t,), generator=g)
    u.requires_grad_(), it.requires_grad_()
    ref = torch.nn.functional.cross_entropy(u @ it.t() * 3.0, idx)
    ref_gu, ref_git = torch.autograd.grad(ref * 0.7, (u, it))
    u32, it32 = u.detach().float().requires_grad_(), it.detach().float().requires_grad_()
    out = softmax_cross_entropy(u32, it32, idx, 3.0, chunk_rows=chunk)
    gu, git = torch.autograd.grad(out * 0.7, (u32, it32))
    assert out.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-5)
    torch.testing.assert_close(gu.double(), ref_gu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(git.double(), ref_git, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [3, None])
def test_chunked_softmax_cross_entropy_leaves_excluded_pairs_out(chunk):
    """Excluded (token, item) pairs: the loss and gradients of the logits with those
    entries at -inf, whichever chunks the pairs fall in."""
    from genrec.kernels.softmax_ce import softmax_cross_entropy

    g = torch.Generator().manual_seed(3)
    t, n, d = 11, 9, 4
    u = torch.randn(t, d, generator=g, dtype=torch.float64, requires_grad=True)
    it = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(n, (t,), generator=g)
    pairs = [(r, c) for r in range(t) for c in range(n) if c != idx[r] and (r * 7 + c * 3) % 4 == 0]
    pairs.append((5, int(idx[5])))  # the token's own target: ignored
    rows, cols = (torch.tensor(x) for x in zip(*pairs))
    logits = (u @ it.t() * 2.0).index_put((rows[:-1], cols[:-1]), torch.tensor(float("-inf"), dtype=torch.float64))
    ref = torch.nn.functional.cross_entropy(logits, idx)
    ref_gu, ref_git = torch.autograd.grad(ref, (u, it))
    u32, it32 = u.detach().float().requires_grad_(), it.detach().float().requires_grad_()
    flat = (rows * n + cols).sort().values
    out = softmax_cross_entropy(u32, it32, idx, 2.0, chunk_rows=chunk, exclude=flat)
    gu, git = torch.autograd.grad(out, (u32, it32))
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    assert out.item() < softmax_cross_entropy(u32, it32, idx, 2.0).item()
    torch.testing.assert_close(gu.double(), ref_gu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(git.double(), ref_git, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="must lie in"):
        softmax_cross_entropy(u32, it32, idx, 2.0, exclude=torch.tensor([t * n]))


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_chunked_softmax_cross_entropy_under_the_training_matmul_precisions(precision):
    """train.matmul_precision may route the loss GEMMs to oneDNN (bf16 inside on CPUs with
    fast bf16): the loss and gradients stay within bf16 rounding of the fp64 reference."""
    from genrec.kernels.softmax_ce import softmax_cross_entropy

    g = torch.Generator().manual_seed(5)
    u = torch.nn.functional.normalize(torch.randn(300, 64, generator=g, dtype=torch.float64), dim=-1)
    it = torch.nn.functional.normalize(torch.randn(500, 64, generator=g, dtype=torch.float64), dim=-1)
    idx = torch.randint(500, (300,), generator=g)
    u.requires_grad_(), it.requires_grad_()
    ref = torch.nn.functional.cross_entropy(u @ it.t() * 20.0, idx)
    ref_gu, ref_git = torch.autograd.grad(ref, (u, it))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        u32, it32 = u.detach().float().requires_grad_(), it.detach().float().requires_grad_()
        out = softmax_cross_entropy(u32, it32, idx, 20.0)
        gu, git = torch.autograd.grad(out, (u32, it32))
    finally:
        torch.set_float32_matmul_precision(before)
    assert out.item() == pytest.approx(ref.item(), rel=1e-2)
    for a, b in ((gu, ref_gu), (git, ref_git)):
        assert ((a.double() - b).norm() / b.norm()).item() < 2e-2


def test_chunked_softmax_cross_entropy_keeps_fp32_under_bf16_autocast():
    from genrec.kernels.softmax_ce import softmax_cross_entropy

    u = torch.randn(64, 16, requires_grad=True)
    it = torch.randn(40, 16)
    idx = torch.randint(40, (64,))
    ref = torch.nn.functional.cross_entropy(u @ it.t(), idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = softmax_cross_entropy(u, it, idx)
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    out.backward()
    assert u.grad.dtype == torch.float32 and torch.isfinite(u.grad).all()


@pytest.mark.parametrize("scale,chunk", [(20.0, None), (20.0, 7), (90.0, 7)])  # 90: the row max is needed
def test_chunked_softmax_cross_entropy_with_bf16_gemms(scale, chunk):
    """gemm_dtype=bf16 (what a bf16 training step runs): the loss and gradients within bf16
    rounding of the fp64 reference, excluded pairs still left out, on both sides of the
    bound below which the row max is skipped."""
    from genrec.kernels.softmax_ce import SHIFT_FREE_BOUND, softmax_cross_entropy

    g = torch.Generator().manual_seed(7)
    t, n = 90, 400
    u = torch.nn.functional.normalize(torch.randn(t, 64, generator=g, dtype=torch.float64), dim=-1)
    it = torch.nn.functional.normalize(torch.randn(n, 64, generator=g, dtype=torch.float64), dim=-1)
    idx = torch.randint(n, (t,), generator=g)
    flat = torch.unique(torch.randint(t * n, (2000,), generator=g))
    flat = flat[flat % n != idx[flat // n]]  # (the kernel ignores a token's own target; the reference would not)
    u.requires_grad_(), it.requires_grad_()
    logits = (u @ it.t() * scale).view(-1).index_fill(0, flat, float("-inf")).view(t, n)
    ref = torch.nn.functional.cross_entropy(logits, idx)
    ref_gu, ref_git = torch.autograd.grad(ref, (u, it))
    assert (scale > SHIFT_FREE_BOUND) == (scale == 90.0)
    u32, it32 = u.detach().float().requires_grad_(), it.detach().float().requires_grad_()
    out = softmax_cross_entropy(u32, it32, idx, scale, chunk_rows=chunk, exclude=flat, gemm_dtype=torch.bfloat16)
    gu, git = torch.autograd.grad(out, (u32, it32))
    assert out.dtype == torch.float32 and gu.dtype == torch.float32
    assert out.item() == pytest.approx(ref.item(), rel=1e-2)
    for a, b in ((gu, ref_gu), (git, ref_git)):
        assert ((a.double() - b).norm() / b.norm()).item() < 2e-2
    exact = softmax_cross_entropy(u32, it32, idx, scale, chunk_rows=chunk, exclude=flat)
    assert exact.item() == pytest.approx(ref.item(), rel=1e-5)
