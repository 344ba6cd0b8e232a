"""kernels.hstu_train: the native training attention beyond the parity test's cases (which
run it against the reference in fp32, tests/test_hstu_parity.py): the layer's own inputs
(bf16 column slices of one projection), threads, and where "auto" runs it."""

from __future__ import annotations

import pytest
import torch

from genrec.kernels import hstu_attention as ha
from genrec.kernels import hstu_train
from genrec.kernels.jagged import lengths_to_offsets
from tests.conftest import kernel_or_skip

N = 128


@pytest.fixture
def built() -> None:
    kernel_or_skip(hstu_train._library(), "hstu_train.cpp")


def case(lengths: list[int], dtype: torch.dtype, seed: int = 0, targets: bool = False):
    """q, k, v as the HSTU layer hands them: column slices [T, 1, 32] of one [T, 128]
    projection (u | v | q | k), in ``dtype``; the bias weights and times."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    t = int(lens.sum())
    uvqk = (torch.randn(t, 128, generator=g) * 2).to(dtype).requires_grad_()
    _, v, q, k = (x.unflatten(-1, (1, 32)) for x in uvqk.split(32, -1))
    ts = torch.cumsum(torch.randint(0, 5000, (t,), generator=g), 0)
    kw = dict(max_seq_len=N, alpha=32**-0.5, pos_weights=torch.randn(N, generator=g).requires_grad_(),
              time_weights=torch.randn(16, generator=g).requires_grad_(), timestamps=ts, query_times=ts + 7)
    if targets:
        kw["num_targets"] = torch.minimum(lens, torch.full_like(lens, 3))
    return uvqk, q, k, v, lengths_to_offsets(lens), kw


def grads(out: torch.Tensor, leaves: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return list(torch.autograd.grad(out, leaves, g))


@pytest.mark.parametrize("targets", [False, True])
def test_bf16_column_slices_match_the_reference_in_fp32(built, targets):
    # what autocast hands the kernel in training: bf16 views into the layer's projection
    uvqk, q, k, v, offsets, kw = case([0, 37, 100, 5, 128], torch.bfloat16, targets=targets)
    assert hstu_train.supported(q, k, v, 128) and q.stride(0) == 128
    out = ha.hstu_attention(q, k, v, offsets, backend="native", **kw)
    assert out.dtype == torch.bfloat16
    leaves = [uvqk, kw["pos_weights"], kw["time_weights"]]
    got = grads(out, leaves)
    ref = ha.hstu_attention_reference(q.float(), k.float(), v.float(), offsets, **kw)
    want = grads(ref, leaves)
    # bf16 products, fp32 sums; P and dS rounded to bf16 for the GEMMs that read them (where the
    # CPU has bf16 dot products), as PyTorch's bf16 attention rounds them: no further from the
    # fp32 reference than the coded backend run in bf16
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=2e-2)
    coded = ha.hstu_attention(q, k, v, offsets, backend="coded", **kw)
    assert (out.float() - ref).abs().mean() <= 1.1 * (coded.float() - ref).abs().mean()
    for a, b, c in zip(got, want, grads(coded, leaves)):
        scale = float(b.abs().max())
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2 * scale, rtol=2e-2)
        assert (a.float() - b).abs().max() <= 1.1 * (c.float() - b).abs().max()


def test_one_thread_and_two_give_the_same_result(built):
    uvqk, q, k, v, offsets, kw = case([90, 3, 128, 60, 0, 77, 128], torch.float32, seed=3)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = ha.hstu_attention(q, k, v, offsets, backend="native", **kw)
            results.append([out, *grads(out, [uvqk, kw["pos_weights"], kw["time_weights"]])])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-5)


def test_auto_runs_the_native_kernel_on_cpu_and_the_coded_path_past_its_length(built, monkeypatch):
    calls = []
    real = hstu_train._NativeAttention.apply
    monkeypatch.setattr(hstu_train._NativeAttention, "apply", lambda *a: calls.append(1) or real(*a))
    _, q, k, v, offsets, kw = case([20, 40], torch.float32)
    out = ha.hstu_attention(q, k, v, offsets, **kw)
    assert calls == [1]
    torch.testing.assert_close(out, ha.hstu_attention(q, k, v, offsets, backend="coded", **kw), atol=1e-6, rtol=1e-5)
    # past MAX_LEN (a user's [L, L] scratch per thread) the coded backend serves
    monkeypatch.setattr(hstu_train, "MAX_LEN", 30)
    ha.hstu_attention(q, k, v, offsets, **kw)
    assert calls == [1]


def test_a_strongly_negative_score_leaves_finite_gradients(built):
    # scores far below zero: SiLU's sigmoid underflows (the kernel flushes denormals); the
    # gradients stay finite and match the reference's
    uvqk, q, k, v, offsets, kw = case([64, 128], torch.float32, seed=5)
    kw["pos_weights"] = (torch.randn(N) * 40 - 120).requires_grad_()
    out = ha.hstu_attention(q, k, v, offsets, backend="native", **kw)
    got = grads(out, [uvqk, kw["pos_weights"]])
    ref = ha.hstu_attention_reference(q, k, v, offsets, **kw)
    want = grads(ref, [uvqk, kw["pos_weights"]])
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-4)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()) + 1e-30, rtol=1e-4)


def test_asking_for_the_native_backend_where_it_cannot_run_says_why(built):
    _, q, k, v, offsets, kw = case([20, 40], torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        ha.hstu_attention(q[..., :24], k[..., :24], v, offsets, backend="native", **kw)


def test_activation_checkpointing_gives_the_same_gradients(built):
    # under non-reentrant checkpointing the tensors backward unpacks are recomputed ones: the
    # kernel's arguments must come from them, not from pointers kept by the forward
    from torch.utils.checkpoint import checkpoint

    uvqk, q, k, v, offsets, kw = case([30, 0, 77, 128], torch.bfloat16, seed=2)
    leaves = [uvqk, kw["pos_weights"], kw["time_weights"]]

    def attend(x: torch.Tensor) -> torch.Tensor:
        _, vv, qq, kk = (c.unflatten(-1, (1, 32)) for c in x.split(32, -1))
        return ha.hstu_attention(qq, kk, vv, offsets, backend="native", **kw) * 1.0

    want = grads(attend(uvqk), leaves)
    got = grads(checkpoint(attend, uvqk, use_reentrant=False), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_flop_count_sees_the_native_attention(built):
    # FlopCounterMode sees no aten op inside the native call: the step's MFU counted its
    # attention as zero until the kernel reported its work (kernels.flops)
    from genrec.train.observe.stepstats import FlopCount

    lengths = [0, 37, 100, 5, 128]
    uvqk, q, k, v, offsets, kw = case(lengths, torch.float32)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    count = FlopCount()
    out = ha.hstu_attention(q, k, v, offsets, backend="native", **kw)
    forward = count.finish()
    assert forward == pairs * 2 * (32 + 32)  # scores and P v over the causal triangle
    count = FlopCount()
    grads(out, [uvqk])
    assert count.finish() == 2 * forward


def test_bf16_inputs_run_bf16_gemms_where_the_cpu_has_them(built):
    # the bf16 path is chosen at build time (-march=native): a build that lost it would widen
    # every bf16 step's attention to fp32 GEMMs, silently, at half the rate
    assert hstu_train.bf16_gemms() == bool(torch.cpu._is_avx512_bf16_supported())
    uvqk, q, k, v, offsets, kw = case([3, 40, 17], torch.bfloat16)
    out = ha.hstu_attention(q, k, v, offsets, backend="native", **kw)
    widened = ha.hstu_attention(q.float(), k.float(), v.float(), offsets, backend="native", **kw)
    # fp32 GEMMs on the widened inputs round only at the end; bf16 GEMMs round P first
    assert torch.equal(out, widened.bfloat16()) != hstu_train.bf16_gemms()
