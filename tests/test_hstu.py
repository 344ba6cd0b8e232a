"""HSTU attention and tower: jagged reference vs independent per-sequence math, padded vs jagged.

Every backend against the reference: tests/test_hstu_parity.py."""

import pytest
import torch
import torch.nn.functional as F

from genrec.kernels.hstu_attention import hstu_attention, time_bucket
from genrec.kernels.jagged import jagged_to_padded, lengths_to_offsets
from genrec.models.hstu import HSTUConfig, HSTUTower, JaggedMeta

MAX_SEQ_LEN = 24


def loop_attention(q, k, v, lengths, pos_w, time_w, ts, qt, num_targets=None):
    """The HSTU formula written per sequence and per (i, j) pair: no padding, no masks."""
    out, start = [], 0
    for b, n in enumerate(lengths.tolist()):
        nt = 0 if num_targets is None else int(num_targets[b])
        hist = n - nt
        for i in range(n):
            acc = torch.zeros_like(v[0])
            for j in range(n):
                allowed = (j <= i) if i < hist else (j < hist or j == i)
                if not allowed:
                    continue
                s = (q[start + i] * k[start + j]).sum(-1) * q.shape[-1] ** -0.5
                pi, pj = min(i, hist), min(j, hist)  # candidates sit right after the history
                s = s + pos_w[min(max(pi - pj, 0), MAX_SEQ_LEN - 1)]
                s = s + time_w[time_bucket(qt[start + i] - ts[start + j], time_w.numel())]
                acc = acc + (F.silu(s) / MAX_SEQ_LEN)[:, None] * v[start + j]
            out.append(acc)
        start += n
    return torch.stack(out) if out else v.new_zeros(v.shape)


def random_case(lengths, heads=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = int(sum(lengths))
    q, k, v = (torch.randn(t, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    ts = torch.cumsum(torch.randint(0, 5000, (t,), generator=g), 0)
    qt = ts + torch.randint(0, 100, (t,), generator=g)
    pos_w = torch.randn(MAX_SEQ_LEN, generator=g, dtype=torch.float64)
    time_w = torch.randn(16, generator=g, dtype=torch.float64)
    return q, k, v, torch.tensor(lengths), pos_w, time_w, ts, qt


@pytest.mark.parametrize("lengths", [[5, 1, 7], [0, 3, 0, 4], [1], [9, 9]])
def test_jagged_reference_matches_per_pair_loop(lengths):
    q, k, v, lens, pos_w, time_w, ts, qt = random_case(lengths)
    out = hstu_attention(q, k, v, lengths_to_offsets(lens), max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5,
                         pos_weights=pos_w, time_weights=time_w, timestamps=ts, query_times=qt)
    torch.testing.assert_close(out, loop_attention(q, k, v, lens, pos_w, time_w, ts, qt))


@pytest.mark.parametrize("num_targets", [None, [3, 0, 5]])
def test_query_blocked_reference_matches_per_pair_loop(num_targets):
    """Inference on long sequences goes through the queries in blocks; same numbers."""
    from genrec.kernels.hstu_attention import hstu_attention_reference

    lengths = [11, 2, 9]
    nt = None if num_targets is None else torch.tensor(num_targets)
    q, k, v, lens, pos_w, time_w, ts, qt = random_case(lengths, seed=3)
    expect = loop_attention(q, k, v, lens, pos_w, time_w, ts, qt, nt)
    for block in (1, 4, 5, 11):
        with torch.no_grad():
            out = hstu_attention_reference(q, k, v, lengths_to_offsets(lens), max_seq_len=MAX_SEQ_LEN,
                                           alpha=8**-0.5, pos_weights=pos_w, time_weights=time_w, timestamps=ts,
                                           query_times=qt, num_targets=nt, query_block=block)
        torch.testing.assert_close(out, expect)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("num_targets", [None, [3, 0, 5]])
@pytest.mark.parametrize("long", [True, False])
def test_inference_path_matches_loop_blocked_and_shares_its_plan(monkeypatch, heads, num_targets, long):
    """The serving path (one bias code per pair, baddbmm) in query blocks, with the plan
    one layer built reused by another layer's weights: same numbers as the loop."""
    import genrec.kernels.hstu_attention as ha
    import genrec.kernels.hstu_reference as hr

    if long:
        monkeypatch.setattr(hr, "QUERY_BLOCK", 2)  # 11 > 2 * 2: blocks of QUERY_BLOCK = 2 query rows
    else:
        monkeypatch.setattr(hr, "CAUSAL_BLOCK", 2)  # a short sequence: blocks of CAUSAL_BLOCK = 2 rows
    lengths = [11, 2, 9]
    nt = None if num_targets is None else torch.tensor(num_targets)
    q, k, v, lens, pos_w, time_w, ts, qt = random_case(lengths, heads=heads, seed=5)
    plan = ha.AttentionPlan()
    kw = dict(max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5, timestamps=ts, query_times=qt, num_targets=nt, plan=plan)
    for pw, tw in ((pos_w, time_w), (pos_w.flip(0), time_w * 2)):
        out = ha.hstu_attention(q, k, v, lengths_to_offsets(lens), pos_weights=pw, time_weights=tw, **kw)
        torch.testing.assert_close(out, loop_attention(q, k, v, lens, pw, tw, ts, qt, nt))
    assert plan.groups is None
    blocks = plan.coded.blocks
    assert [r for r, _ in blocks] == [(s, min(s + 2, 11)) for s in range(0, 11, 2)]


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("num_targets", [None, [3, 0, 5]])
@pytest.mark.parametrize("terms", ["both", "position", "time"])
def test_training_path_gradients_match_the_loop(monkeypatch, heads, num_targets, terms):
    """Autograd through the training path (one bias code per pair, query blocks of 4 rows,
    the hand-written backward of ``_CodedAttention``): the loop's output and the loop's
    gradients for q, k, v and each bias table the layer has."""
    import genrec.kernels.hstu_attention as ha
    import genrec.kernels.hstu_reference as hr

    monkeypatch.setattr(hr, "CAUSAL_BLOCK", 4)  # 11 rows: blocks 0-4, 4-8, 8-11
    lengths = [11, 2, 9]
    nt = None if num_targets is None else torch.tensor(num_targets)
    q, k, v, lens, pos_w, time_w, ts, qt = random_case(lengths, heads=heads, seed=7)
    for t in (q, k, v, pos_w, time_w):
        t.requires_grad_()
    pw = pos_w if terms != "time" else None
    tw = time_w if terms != "position" else None
    out = ha.hstu_attention(q, k, v, lengths_to_offsets(lens), max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5, pos_weights=pw,
                            time_weights=tw, timestamps=ts, query_times=qt, num_targets=nt, plan=ha.AttentionPlan())
    ref = loop_attention(q, k, v, lens, pos_w if pw is not None else torch.zeros_like(pos_w),
                         time_w if tw is not None else torch.zeros_like(time_w), ts, qt, nt)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    used = [q, k, v] + [t for t in (pw, tw) if t is not None]
    for name, got, want in zip(["q", "k", "v", "table", "table"], torch.autograd.grad(out, used, grad),
                               torch.autograd.grad(ref, used, grad)):
        torch.testing.assert_close(got, want, msg=lambda m, n=name: f"grad {n}: {m}")


def test_inference_path_without_bias_terms():
    q, k, v, lens, pos_w, time_w, ts, qt = random_case([4, 3], seed=6)
    zero_p, zero_t = torch.zeros_like(pos_w), torch.zeros_like(time_w)
    out = hstu_attention(q, k, v, lengths_to_offsets(lens), max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5)
    torch.testing.assert_close(out, loop_attention(q, k, v, lens, zero_p, zero_t, ts, qt))


@pytest.mark.parametrize("heads", [1, 2])
def test_last_row_attention_equals_the_full_pass_at_each_last_row(heads):
    from genrec.kernels.hstu_attention import hstu_last_row_attention

    lengths = [5, 1, 7, 2]
    q, k, v, lens, pos_w, time_w, ts, qt = random_case(lengths, heads=heads, seed=8)
    offsets = lengths_to_offsets(lens)
    kw = dict(max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5, pos_weights=pos_w, time_weights=time_w, timestamps=ts,
              query_times=qt)
    full = loop_attention(q, k, v, lens, pos_w, time_w, ts, qt)
    torch.testing.assert_close(hstu_last_row_attention(q, k, v, offsets, **kw), full[offsets[1:] - 1])
    no_time = {**kw, "time_weights": None}
    torch.testing.assert_close(hstu_last_row_attention(q, k, v, offsets, **no_time),
                               hstu_attention(q, k, v, offsets, **no_time)[offsets[1:] - 1])


def test_target_aware_mask_matches_loop_and_isolates_candidates():
    lengths, nt = [6, 4], torch.tensor([3, 1])
    q, k, v, lens, pos_w, time_w, ts, qt = random_case(lengths, seed=1)
    kw = dict(max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5, pos_weights=pos_w, time_weights=time_w,
              timestamps=ts, query_times=qt, num_targets=nt)
    offsets = lengths_to_offsets(lens)
    out = hstu_attention(q, k, v, offsets, **kw)
    torch.testing.assert_close(out, loop_attention(q, k, v, lens, pos_w, time_w, ts, qt, nt))
    # changing one candidate leaves every other row unchanged
    k2, v2 = k.clone(), v.clone()
    k2[4], v2[4] = k2[4] + 1.0, v2[4] - 2.0
    out2 = hstu_attention(q, k2, v2, offsets, **kw)
    rows = [r for r in range(10) if r != 4]
    torch.testing.assert_close(out[rows], out2[rows])


def test_attention_gradients_match_loop():
    q, k, v, lens, pos_w, time_w, ts, qt = random_case([4, 2, 5], seed=2)
    leaves = [x.requires_grad_() for x in (q, k, v, pos_w, time_w)]
    out = hstu_attention(q, k, v, lengths_to_offsets(lens), max_seq_len=MAX_SEQ_LEN, alpha=8**-0.5,
                         pos_weights=pos_w, time_weights=time_w, timestamps=ts, query_times=qt)
    g1 = torch.autograd.grad(out.square().sum(), leaves)
    ref = loop_attention(q, k, v, lens, pos_w, time_w, ts, qt)
    g2 = torch.autograd.grad(ref.square().sum(), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def make_tower(seed=0):
    torch.manual_seed(seed)
    tower = HSTUTower(HSTUConfig(num_layers=2, num_heads=2, qk_dim=8, v_dim=8, dropout=0.0), 16, MAX_SEQ_LEN)
    return tower.double().eval()


def test_tower_jagged_equals_padded_formulation():
    tower = make_tower()
    lengths = torch.tensor([5, 1, 7, 3])
    t = int(lengths.sum())
    x = torch.randn(t, 16, dtype=torch.float64)
    ts = torch.cumsum(torch.randint(0, 1000, (t,)), 0)
    qt = ts + 7
    offsets = lengths_to_offsets(lengths)
    jag = tower(x, JaggedMeta(offsets, int(lengths.max()), ts, qt, None))
    n = int(lengths.max())
    pad = tower.forward_padded(jagged_to_padded(x, offsets, n), lengths,
                               jagged_to_padded(ts, offsets, n), jagged_to_padded(qt, offsets, n))
    valid = torch.arange(n)[None, :] < lengths[:, None]
    torch.testing.assert_close(jag, pad[valid])
    # serving reads only the last rows: the last layer then attends from them alone
    cache: list = []
    last = tower(x, JaggedMeta(offsets, int(lengths.max()), ts, qt, None), cache=cache, last_only=True)
    torch.testing.assert_close(last, jag[offsets[1:] - 1])
    assert len(cache) == 2 and cache[1][0].shape == (t, 2, 8)


def test_tower_output_does_not_depend_on_batch_mates():
    tower = make_tower(1)
    lengths = torch.tensor([4, 6, 2])
    t = int(lengths.sum())
    x = torch.randn(t, 16, dtype=torch.float64)
    ts = torch.arange(t) * 10
    full = tower(x, JaggedMeta(lengths_to_offsets(lengths), 6, ts, ts + 1, None))
    alone = tower(x[4:10], JaggedMeta(lengths_to_offsets(torch.tensor([6])), 6, ts[4:10], ts[4:10] + 1, None))
    torch.testing.assert_close(full[4:10], alone)
