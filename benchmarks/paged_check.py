"""Incremental HSTU encoding over a paged K/V pool on a device: bf16 pool vs fp32, and time.

What the SGLang model does per forward, without SGLang: a pool of per-layer keys / values
([slots, H, D], fp32 or bf16) and per-slot times; B users whose histories are cached in
scattered slots; a few new events each, written to fresh slots, then attended over the
user's slots through a slot map (``HSTUTower.extend_paged``, ``kernels.hstu_paged``), then
candidates scored against the gathered history (``HSTUTower.extend``). Checks the bf16
pool against the fp32 one and times both.

    python -m genrec.benchmarks.paged_check --device cuda     # benchmarks/gpu_check_sglang.sh
    python -m genrec.benchmarks.paged_check --device cpu --users 4 --history 512
    python -m genrec.benchmarks.paged_check --kernel-only     # the Triton paged kernel vs the gathers

``--kernel-only`` times the attention op alone: the Triton kernel reading the pool in place
(``kernels.hstu_paged_triton``) against the reference's per-sequence gathers, fp32 and bf16 pools
(on CPU only under TRITON_INTERPRET=1, at a small shape).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from genrec.models.hstu import CachedHistory, HSTUConfig, HSTUTower, JaggedMeta, PagedMeta


def run(device: str, users: int, history: int, new: int, candidates: int, pool_dtype: torch.dtype,
        reps: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(new tokens' outputs, candidates' outputs, ms per step) with a pool of ``pool_dtype``."""
    torch.manual_seed(0)
    dev = torch.device(device)
    cfg = HSTUConfig(num_layers=2, num_heads=2, qk_dim=64, v_dim=64, dropout=0.0)
    tower = HSTUTower(cfg, 128, max_seq_len=history + new + 1).to(dev).eval()
    n = history + new
    lengths = torch.full((users,), n, device=dev)
    x = torch.randn(users * n, 128, device=dev)
    times = (torch.arange(n, device=dev) * 60 + 1_700_000_000).repeat(users)
    qtimes = times + 60
    offsets = torch.arange(users + 1, device=dev) * n
    with torch.no_grad():
        layers: list = []
        tower(x, JaggedMeta(offsets, n, times, qtimes, None), cache=layers)  # the prefix's K/V, as cached
        slots_total = users * n + 1
        perm = torch.randperm(slots_total - 1, device=dev)[: users * n].view(users, n) + 1  # scattered slots
        pool = [(torch.zeros(slots_total, cfg.num_heads, cfg.qk_dim, device=dev, dtype=pool_dtype),
                 torch.zeros(slots_total, cfg.num_heads, cfg.v_dim, device=dev, dtype=pool_dtype)) for _ in layers]
        slot_time = torch.zeros(slots_total, dtype=torch.int64, device=dev)
        cached = torch.arange(history, device=dev)
        rows = (torch.arange(users, device=dev)[:, None] * n + cached).flatten()
        for (k, v), (kb, vb) in zip(layers, pool):
            kb[perm[:, :history].flatten()] = k[rows].to(pool_dtype)
            vb[perm[:, :history].flatten()] = v[rows].to(pool_dtype)
        slot_time[perm.flatten()] = times
        new_rows = (torch.arange(users, device=dev)[:, None] * n + torch.arange(history, n, device=dev)).flatten()
        loc = perm[:, history:].flatten()
        seq = torch.arange(users, device=dev).repeat_interleave(new)
        meta = PagedMeta(seq, torch.arange(history, n, device=dev).repeat(users), lengths, slot_time[perm],
                         qtimes[new_rows])

        def store(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kb, vb = pool[i]
            kb[loc], vb[loc] = k.to(kb.dtype), v.to(vb.dtype)
            return kb[perm].to(k.dtype), vb[perm].to(v.dtype)

        cands = torch.randn(users * candidates, 128, device=dev)
        owner = torch.arange(users, device=dev).repeat_interleave(candidates)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            h = tower.extend_paged(x[new_rows], meta, store)
            flat = perm.flatten()
            hist = CachedHistory([(kb[flat].float(), vb[flat].float()) for kb, vb in pool], offsets, slot_time[flat],
                                 qtimes[offsets[1:] - 1])
            return h, tower.extend(cands, hist, owner)

        out = step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out[0], out[1], (time.perf_counter() - t) / reps * 1e3


def kernel_check(device: str, users: int, history: int, new: int, reps: int = 10) -> dict:
    """The attention op alone at one layer's shape: the Triton kernel reading the pool in place
    through the slot map against the reference that gathers [B, L, H, D] copies (error, times;
    ``kernels.hstu_paged.hstu_paged_attention_pool``), on an fp32 and a bf16 pool."""
    from genrec.kernels.hstu_paged import hstu_paged_attention_pool

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    heads, dq, dv, n = 2, 64, 64, history + new
    s = users * n + 1
    slots = (torch.randperm(s - 1, device=dev, generator=g)[: users * n] + 1).view(users, n).to(torch.int32)
    seq = torch.arange(users, device=dev).repeat_interleave(new)
    index = torch.arange(history, n, device=dev).repeat(users)
    q = torch.randn(users * new, heads, dq, device=dev, generator=g)
    kw = dict(max_seq_len=n + 1, alpha=1.0 / dq, pos_weights=torch.randn(n + 1, device=dev, generator=g) * 0.1,
              time_weights=torch.randn(64, device=dev, generator=g) * 0.1,
              slot_times=torch.randint(1_700_000_000, 1_700_500_000, (s,), device=dev, generator=g),
              query_times=torch.full((users * new,), 1_700_600_000, device=dev))
    lengths = torch.full((users,), n, device=dev)
    out: dict = {"users": users, "history": history, "new": new}

    def timed(fn) -> tuple[torch.Tensor, float]:  # noqa: ANN001
        res = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return res, (time.perf_counter() - t) / reps * 1e3

    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        kp = torch.randn(s, heads, dq, device=dev, generator=g).to(dtype)
        vp = torch.randn(s, heads, dv, device=dev, generator=g).to(dtype)
        args = (q, kp, vp, slots, seq, index, lengths)
        ref, ms_ref = timed(lambda: hstu_paged_attention_pool(*args, backend="torch", **kw))  # noqa: B023
        got, ms_tri = timed(lambda: hstu_paged_attention_pool(*args, backend="triton", **kw))  # noqa: B023
        out[name] = {"ms_gather_reference": round(ms_ref, 3), "ms_triton_paged": round(ms_tri, 3),
                     "rel_err": float((got - ref).abs().max() / ref.abs().max())}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--history", type=int, default=4000)
    p.add_argument("--new", type=int, default=3)
    p.add_argument("--candidates", type=int, default=200)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--kernel-only", action="store_true", help="only the Triton paged kernel against the reference")
    a = p.parse_args(argv)
    if a.kernel_only:
        print(json.dumps(kernel_check(a.device, a.users, a.history, a.new, a.reps)))
        return
    print(json.dumps(check(a.device, a.users, a.history, a.new, a.candidates, a.reps)))


def check(device: str, users: int, history: int, new: int, candidates: int, reps: int = 10) -> dict:
    """The bf16 pool against the fp32 one at one shape: times and relative errors."""
    shape = (device, users, history, new, candidates)
    h32, c32, ms32 = run(*shape, torch.float32, reps)
    h16, c16, ms16 = run(*shape, torch.bfloat16, reps)
    rel = lambda x, y: float((x - y).abs().max() / y.abs().max())  # noqa: E731
    out = {"device": torch.cuda.get_device_name(0) if device == "cuda" else device,
           "users": users, "history": history, "new": new, "candidates": candidates,
           "ms_fp32_pool": round(ms32, 3), "ms_bf16_pool": round(ms16, 3),
           "bf16_vs_fp32_rel_err_new": rel(h16, h32), "bf16_vs_fp32_rel_err_candidates": rel(c16, c32)}
    if device == "cuda":  # the Triton paged kernel at this shape (on CPU only the interpreter runs it: slow)
        out["kernel"] = kernel_check(device, users, history, new, reps)
    return out


if __name__ == "__main__":
    main()
