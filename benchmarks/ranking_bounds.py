"""What a ranking model could reach on the synthetic ads logs: AUC ceilings below the oracle.

The generator's click probability is ``sigmoid(scale * <u, v_i> / sqrt(P) + bias)``: ``u`` a
hidden per-user preference vector (the user's topic mixture times the topic vectors, plus
N(0, 0.5^2) noise), ``v_i`` a per-item vector (its topic's vector plus N(0, 0.7^2) noise).
The oracle knows ``u`` exactly; a model knows a user only through the history it is shown.
So the oracle is not a reachable target, and this script measures, on the same test
candidates the ranking benchmark scores (``rank_test``: each user's first 64 events after
the test cutoff, in requests of 16 consecutive events, each after every event before it, as
the reader makes them), what estimators that know *more* than any model can learn from the
logs reach:

* ``oracle``: the true probabilities;
* ``world+history``: the generator's exact world (every item vector, scale, bias: what
  infinite training data would teach) and the user's hidden vector inferred from the shown
  history: a Bayesian logistic regression per user (prior: the topic mixture the history's
  items imply, times the topic vectors; evidence: the history's clicks), its posterior
  predictive probability; an upper bound on any model given these histories, up to the
  approximations named in ``infer_users``;
* ``world+topics``: the same without the clicks (the prior alone): what the user's
  interests, not their feedback, tell;
* ``topics+history``: items known only by their topic (no per-item vectors): a model that
  never learned the item-specific part.

``--chunks 16,64``: 64 is the protocol before 2026-12-04 (one request per user, after the
history up to the test cutoff), kept to show what it cost.

    python -m genrec.benchmarks.ranking_bounds [--data data/synthetic_first_order] [--chunks 16,64]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from genrec.benchmarks.common import ROOT, machine, shown_path, today, update_results_md, write_json
from genrec.train.data.files import read_interactions
from genrec.train.data.reader import ranking_cutoffs
from genrec.train.data.samples import RankingDataConfig
from genrec.train.data.synthetic import SyntheticConfig, SyntheticWorld, first_order, hidden_users
from genrec.train.eval.ranking_metrics import auc, normalized_entropy

EVAL_CANDIDATES = RankingDataConfig().eval_candidates  # held-out events per user
REQUEST = RankingDataConfig().num_candidates  # held-out events per request (reader.py)
MAX_SEQ_LEN = 200  # configs/ranking_synthetic.toml model.max_seq_len: a history holds 200 - request events


def conversion_prob(p_click: np.ndarray, cfg: SyntheticConfig) -> np.ndarray:
    """P(click and conversion) from P(click), the generator's rule."""
    return p_click / (1.0 + np.exp(-(p_click * 4 - 2 + cfg.conversion_bias)))


def posterior(world: SyntheticWorld, vecs: np.ndarray, topics: np.ndarray, clicks: np.ndarray,
              use_clicks: bool) -> tuple[np.ndarray, np.ndarray]:
    """Posterior mean [P] and covariance [P, P] of a user's preference vector.

    Prior: N(mix_hat @ T, 0.5^2 I + T' Cov(mix) T), mix_hat the Dirichlet posterior mean of
    the topic mixture given the topic counts of ``topics`` (counting events as independent
    draws overstates what a sticky topic chain says, so the prior is somewhat too sure).
    Evidence: the history's clicks, a logistic likelihood in <u, v>; Laplace approximation
    at the MAP (Newton steps)."""
    cfg = world.cfg
    k, p = cfg.num_topics, cfg.pref_dim
    alpha, a = cfg.interest_concentration, cfg.pref_scale / math.sqrt(p)
    tv = world.topic_vecs
    counts = np.bincount(topics, minlength=k).astype(np.float64)
    total = counts.sum() + k * alpha
    mix = (counts + alpha) / total
    cov_mix = (np.diag(mix) - np.outer(mix, mix)) / (total + 1)
    m = mix @ tv
    prior_prec = np.linalg.inv(0.25 * np.eye(p) + tv.T @ cov_mix @ tv)
    u, hess = m.copy(), prior_prec
    if use_clicks and clicks.size:
        for _ in range(15):
            s = 1.0 / (1.0 + np.exp(-(a * vecs @ u + cfg.click_bias)))
            grad = prior_prec @ (u - m) - a * vecs.T @ (clicks - s)
            hess = prior_prec + (a * a) * (vecs.T * (s * (1 - s))) @ vecs
            step = np.linalg.solve(hess, grad)
            u = u - step
            if np.abs(step).max() < 1e-6:
                break
    return u, np.linalg.inv(hess)


def predictive(world: SyntheticWorld, u: np.ndarray, cov: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Posterior predictive click probability of candidates v [C, P] (the probit approximation)."""
    cfg = world.cfg
    a = cfg.pref_scale / math.sqrt(cfg.pref_dim)
    mu = a * v @ u + cfg.click_bias
    var = (a * a) * np.einsum("ip,pq,iq->i", v, cov, v)
    return 1.0 / (1.0 + np.exp(-mu / np.sqrt(1.0 + math.pi * var / 8)))


def estimate(world: SyntheticWorld, samples: list[tuple], vec_of, use_clicks: bool) -> np.ndarray:  # noqa: ANN001
    """Every sample's candidates' click probabilities, given the sample's history and the
    candidate's own topic (a candidate sees itself, and its topic says the user is
    interested in it): samples of (history items, history clicks, candidate items)."""
    out = []
    for h_items, h_clicks, c_items in samples:
        hv, ht, cv, ct = vec_of(h_items), world.item_topic(h_items), vec_of(c_items), world.item_topic(c_items)
        p = np.empty(c_items.size)
        for t in np.unique(ct):  # candidates of one topic share a posterior
            sel = ct == t
            u, cov = posterior(world, hv, np.append(ht, t), h_clicks.astype(np.float64), use_clicks)
            p[sel] = predictive(world, u, cov, cv[sel])
        out.append(p)
    return np.concatenate(out)


def test_samples(data: Path, chunk: int) -> tuple[list[tuple], np.ndarray, np.ndarray, np.ndarray]:
    """The rank_test candidates (each user's first 64 events from the test cutoff) as samples
    of ``chunk`` consecutive candidates after all events before them (capped as the model's
    history is); chunk 64: one sample per user, history cut at the cutoff (the benchmark's
    protocol). Returns samples, user ids, actions, oracle click probabilities per candidate."""
    _, cut_test = ranking_cutoffs(data, 0.1)
    rows = read_interactions(data, ["user_id", "item_ids", "timestamps", "actions", "oracle_click"]).to_pylist()
    cap = MAX_SEQ_LEN - chunk
    samples, users, acts, oracle = [], [], [], []
    for r in rows:
        idx = np.flatnonzero(np.asarray(r["timestamps"]) >= cut_test)[:EVAL_CANDIDATES]
        items, a = np.asarray(r["item_ids"]), np.asarray(r["actions"])
        for c in range(0, idx.size, chunk):
            first = int(idx[c])
            if first == 0:  # no event before it: cold start, which the reader leaves out
                continue
            s = max(0, first - cap)
            samples.append((items[s:first], (a[s:first] & 2) != 0, items[idx[c:c + chunk]]))
        kept = idx[np.repeat(idx[::chunk] > 0, chunk)[:idx.size]]
        users.append(np.full(kept.size, r["user_id"]))
        acts.append(a[kept])
        oracle.append(np.asarray(r["oracle_click"])[kept])
    return samples, np.concatenate(users), np.concatenate(acts), np.concatenate(oracle)


def bounds(data: Path, chunk: int) -> dict:
    info = json.loads((data / "dataset.json").read_text())
    cfg = first_order(**info["extra"]["synthetic"])  # settings a dataset predates are first-order ones
    world, hidden = SyntheticWorld(cfg), hidden_users(cfg)
    samples, users, acts, oracle = test_samples(data, chunk)
    click, conv = (acts & 2) != 0, (acts & 4) != 0
    items = np.concatenate([s[2] for s in samples])
    p_true = world.click_prob(hidden["user_vec"][users - 1], items)
    assert np.allclose(p_true, oracle, atol=1e-5), "hidden state replay differs from the logged oracle"

    def topic_vecs(items: np.ndarray) -> np.ndarray:
        return world.topic_vecs[world.item_topic(items)]

    estimates = {"oracle": p_true,
                 "world+history": estimate(world, samples, world.item_vectors, True),
                 "world+topics": estimate(world, samples, world.item_vectors, False),
                 "topics+history": estimate(world, samples, topic_vecs, True)}
    out = {}
    for name, p in estimates.items():
        pc = conversion_prob(p, cfg)
        out[name] = {"click/auc": auc(p, click), "click/ne": normalized_entropy(p, click),
                     "conversion/auc": auc(pc, conv), "conversion/ne": normalized_entropy(pc, conv)}
    hist = np.array([s[0].size for s in samples])
    return {"chunk": chunk, "users": int(np.unique(users).size), "candidates": int(click.size),
            "history_median": float(np.median(hist)), "history_empty": float((hist == 0).mean()),
            "click_rate": float(click.mean()), "conversion_rate": float(conv.mean()), "estimators": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "synthetic_first_order"))  # benchmarks/ranking.py's
    ap.add_argument("--chunks", default=f"{REQUEST},{EVAL_CANDIDATES}")
    args = ap.parse_args()
    records = [bounds(Path(args.data), int(c)) for c in args.chunks.split(",")]
    write_json("ranking_bounds", {"records": records, "data": shown_path(args.data), "date": today(), "machine": machine(),
                                  "command": "python -m genrec.benchmarks.ranking_bounds"})
    update_results_md()


NAMES = {"oracle": "oracle (knows the user's hidden vector)",
         "world+history": "knows every item vector; user from the history's topics and clicks",
         "topics+history": "knows item topics only; user from the history's topics and clicks",
         "world+topics": "knows every item vector; user from the history's topics only"}


def ranking_bounds(d: dict) -> list[str]:
    from genrec.benchmarks.report import machine_text, num, table

    out = ["## Ranking ceilings on the synthetic logs (what the shown histories allow)", "",
           "The oracle knows each user's hidden preference vector; a model sees only the user's history. "
           "Estimators that know the generator's whole world (more than any model can learn) but infer the "
           "user from the history the model is shown, on the same test candidates "
           "(`benchmarks/ranking_bounds.py`). Request = held-out events scored together after the events "
           "before them (16: the reader's protocol; 64: one request per user at the test cutoff, the "
           "protocol before 2026-12-04).", ""]
    recs = sorted(d["records"], key=lambda r: r["chunk"])
    head = ["estimator"] + [f"{t} AUC, request {r['chunk']}" for r in recs for t in ("click", "conv.")]
    rows = [[NAMES[k]] + [num(r["estimators"][k][f"{t}/auc"]) for r in recs for t in ("click", "conversion")]
            for k in NAMES]
    out += table(head, rows) + [""]
    out += ["Test candidates: " + ", ".join(f"{r['candidates']} of {r['users']} users (request {r['chunk']}, "
                                            f"median history {r['history_median']:.0f} events)" for r in recs)
            + f". Machine: {machine_text(d['machine'])}; {d['date']}. Command: `{d['command']}`.", ""]
    return out


def ranking_bounds_summary(d: dict) -> tuple[str, str]:
    r = min(d["records"], key=lambda r: r["chunk"])["estimators"]
    return (f"click AUC ceiling {r['world+history']['click/auc']:.3f} given the histories",
            f"oracle {r['oracle']['click/auc']:.3f}")


if __name__ == "__main__":
    main()
