"""Every backend of every HSTU op against the op's reference, on random jagged shapes.

The backends come from the ops' own registries (``kernels.hstu_attention.OP_BACKENDS``,
``models.hstu.TOWER_BACKENDS``), so a backend added there is checked here without a new
test: forward always, backward wherever the backend has one. Shapes are drawn per seed:
zero-length sequences, lengths not divisible by the query blocks (64) or Triton's tiles,
with and without candidates and each bias term. Triton runs on CPU under
``TRITON_INTERPRET=1``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is imported

from genrec.kernels import hstu_attention as ha  # noqa: E402
from genrec.kernels.jagged import lengths_to_offsets  # noqa: E402
from genrec.models.hstu import TOWER_BACKENDS, HSTUConfig, HSTUTower, JaggedMeta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 96  # max_seq_len
SEEDS = range(3)
# a tower whose candidates' attention runs in bf16 (8 mantissa bits): its outputs (after the
# final LayerNorm, ~unit scale) within 0.05 of the fp32 reference's; a wrong bias, mask or
# candidate order reads off by ~1
BF16_TOWER = dict(atol=5e-2, rtol=5e-2)
REFERENCE = {"hstu_attention": ha.hstu_attention_reference,
             "hstu_last_row_attention": ha.hstu_last_row_attention_reference,
             "hstu_cached_attention": ha.hstu_cached_attention_reference}


def fast(op: str) -> list[str]:
    return [b for b in ha.OP_BACKENDS[op] if b != "reference"]


def draw_lengths(g: torch.Generator, min_len: int = 0) -> torch.Tensor:
    """3-5 sequences: one empty (unless ``min_len``), one past a query block of 64, the rest
    random; none of the long ones a multiple of 16."""
    b = int(torch.randint(3, 6, (1,), generator=g))
    lens = torch.randint(max(min_len, 1), 40, (b,), generator=g)
    lens[0] = min_len
    lens[1] = 65 + int(torch.randint(0, 12, (1,), generator=g)) * 2  # 65..87, odd
    return lens[torch.randperm(b, generator=g)]


def draw_case(seed: int, min_len: int = 0, targets: bool | None = None):
    g = torch.Generator().manual_seed(seed)
    lens = draw_lengths(g, min_len)
    t = int(lens.sum())
    heads = int(torch.randint(1, 3, (1,), generator=g))
    dqk, dv = (16, 32)[seed % 2], 16
    mk = lambda d: (torch.randn(t, heads, d, generator=g) * 0.5).to(DEVICE).requires_grad_()  # noqa: E731
    terms = ("both", "position", "time", "none")[seed % 4]
    ts = torch.cumsum(torch.randint(0, 3000, (t,), generator=g), 0)
    kw = dict(max_seq_len=N, alpha=dqk**-0.5,
              pos_weights=torch.randn(N, generator=g).requires_grad_() if terms in ("both", "position") else None,
              time_weights=torch.randn(24, generator=g).requires_grad_() if terms in ("both", "time") else None,
              timestamps=ts.to(DEVICE), query_times=(ts + torch.randint(0, 90, (t,), generator=g)).to(DEVICE))
    if targets if targets is not None else seed % 2 == 0:
        kw["num_targets"] = torch.minimum(lens, torch.randint(0, 4, lens.shape, generator=g)).to(DEVICE)
    return mk(dqk), mk(dqk), mk(dv), lengths_to_offsets(lens).to(DEVICE), kw


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to fp32 rounding: 1e-5 of the largest magnitude, 1e-4 of each element (a
    backend's rounding reads ~1e-6 off; a 0.1% slip anywhere fails)."""
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def compare(out: torch.Tensor, ref: torch.Tensor, leaves: list, what: str) -> None:
    """The forward, and the gradients of every leaf (q, k, v, bias tables) for one random
    output gradient."""
    close(out, ref, f"{what} forward")
    grad = torch.randn_like(ref)
    used = [x for x in leaves if x is not None]
    got = torch.autograd.grad(out, used, grad, allow_unused=True)
    want = torch.autograd.grad(ref, used, grad, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None:  # a leaf one side never read: the other must not depend on it either
            assert (a if a is not None else b) is None or (a if a is not None else b).abs().max() == 0, f"{what} grad {i}"
            continue
        close(a, b, f"{what} grad of leaf {i}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", fast("hstu_attention"))
def test_attention_backend_matches_the_reference(backend, seed):
    q, k, v, offsets, kw = draw_case(seed)
    out = ha.hstu_attention(q, k, v, offsets, backend=backend, **kw)
    ref = REFERENCE["hstu_attention"](q, k, v, offsets, **kw)
    compare(out, ref, [q, k, v, kw["pos_weights"], kw["time_weights"]], f"hstu_attention[{backend}]")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", fast("hstu_last_row_attention"))
def test_last_row_backend_matches_the_reference(backend, seed):
    q, k, v, offsets, kw = draw_case(seed, min_len=1, targets=False)
    out = ha.hstu_last_row_attention(q, k, v, offsets, backend=backend, **kw)
    ref = REFERENCE["hstu_last_row_attention"](q, k, v, offsets, **kw)
    compare(out, ref, [q, k, v, kw["pos_weights"], kw["time_weights"]], f"hstu_last_row_attention[{backend}]")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", fast("hstu_cached_attention"))
def test_cached_backend_matches_the_reference(backend, seed):
    """Candidates of users in any order (some users with none, one with an empty history)
    against the users' cached keys and values."""
    kh, _, vh, offsets, kw = draw_case(seed, targets=False)
    g = torch.Generator().manual_seed(100 + seed)
    b, heads = offsets.numel() - 1, kh.shape[1]
    owner = torch.randint(0, b, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
    mk = lambda d: (torch.randn(owner.numel(), heads, d, generator=g) * 0.5).requires_grad_()  # noqa: E731
    q, k, v = mk(kh.shape[-1]), mk(kh.shape[-1]), mk(vh.shape[-1])
    args = dict(max_seq_len=N, alpha=kw["alpha"], pos_weights=kw["pos_weights"], time_weights=kw["time_weights"],
                hist_times=kw["timestamps"], request_times=kw["timestamps"].max() + torch.randint(0, 99, (b,)))
    out = ha.hstu_cached_attention(q, k, v, kh, vh, offsets, owner, backend=backend, **args)
    ref = REFERENCE["hstu_cached_attention"](q, k, v, kh, vh, offsets, owner, **args)
    compare(out, ref, [q, k, v, kh, vh, kw["pos_weights"], kw["time_weights"]], f"hstu_cached_attention[{backend}]")


def make_tower(seed: int, time_bias: bool) -> HSTUTower:
    torch.manual_seed(seed)
    heads = 1 + seed % 2
    cfg = HSTUConfig(num_layers=2, num_heads=heads, qk_dim=16 // heads, v_dim=16 // heads, dropout=0.0,
                     time_bias=time_bias, num_time_buckets=32, attention_backend="reference")
    tower = HSTUTower(cfg, 24, N).eval()
    with torch.no_grad():  # biases big enough to matter
        for layer in tower.layers:
            layer.pos_weights.normal_(0, 1.0)
            if layer.time_weights is not None:
                layer.time_weights.normal_(0, 1.0)
    return tower


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", [b for b in TOWER_BACKENDS if b != "torch"] + ["torch-coded"])
def test_tower_backend_matches_the_reference(backend, seed):
    """The tower's serving methods (encode a history, read its last rows, extend it with
    candidates) on each backend against its layers with the reference attention."""
    tower = make_tower(seed, time_bias=seed != 1)
    if backend == "native" and not tower.native_supported():
        pytest.skip("the native kernels did not build here")
    g = torch.Generator().manual_seed(seed)
    lens = draw_lengths(g, min_len=1)
    t, b = int(lens.sum()), lens.numel()
    x = torch.randn(t, 24, generator=g)
    ts = torch.cumsum(torch.randint(0, 5000, (t,), generator=g), 0)
    meta = lambda: JaggedMeta(lengths_to_offsets(lens), int(lens.max()), ts, ts + 3, None)  # noqa: E731
    owner = torch.repeat_interleave(torch.randperm(b, generator=g), torch.randint(0, 4, (b,), generator=g))
    cands = torch.randn(owner.numel(), 24, generator=g)
    with torch.inference_mode():
        ref_h, ref_hist = tower.encode_history(x, meta())
        ref_c = tower.extend(cands, ref_hist, owner)
        if backend == "torch-coded":
            for layer in tower.layers:
                layer.cfg = HSTUConfig(**{**layer.cfg.__dict__, "attention_backend": "coded"})
            h, hist = tower.encode_history(x, meta())
            c = tower.extend(cands, hist, owner)
            c_from_ref = tower.extend(cands, ref_hist, owner)
        else:
            h, hist = tower.encode_history(x, meta(), backend=backend)
            c = tower.extend(cands, hist, owner, backend=backend)
            c_from_ref = tower.extend(cands, ref_hist, owner, backend=backend)  # a history the layers encoded
    torch.testing.assert_close(h, ref_h, atol=2e-5, rtol=1e-4, msg=lambda m: f"encode_history[{backend}]: {m}")
    tol = BF16_TOWER if backend.endswith("bf16") else dict(atol=2e-5, rtol=1e-4)  # (the candidates' GEMMs in bf16)
    for i, ((k, v), (rk, rv)) in enumerate(zip(tower.cached_layers(hist), ref_hist.layers)):
        torch.testing.assert_close(k, rk, atol=2e-5, rtol=1e-4, msg=lambda m, i=i: f"layer {i} keys[{backend}]: {m}")
        torch.testing.assert_close(v, rv, atol=2e-5, rtol=1e-4, msg=lambda m, i=i: f"layer {i} values[{backend}]: {m}")
    torch.testing.assert_close(c, ref_c, **tol, msg=lambda m: f"extend[{backend}]: {m}")
    torch.testing.assert_close(c_from_ref, ref_c, **tol, msg=lambda m: f"extend[{backend}]: {m}")
    if backend == "native":  # the retrieval readout fused into the final norm
        with torch.inference_mode():
            h2, _ = tower.encode_history(x, meta(), backend=backend, l2=True)
        torch.testing.assert_close(h2, torch.nn.functional.normalize(ref_h, dim=-1, eps=1e-6), atol=2e-5, rtol=1e-4)
