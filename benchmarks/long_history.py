"""What a history window that moves in blocks costs in retrieval quality (issue 32).

    python -m genrec.benchmarks.long_history [--run RUN_DIR] [--blocks 1,8,16,32,64] [--no-test]

A server that keeps users' encoded histories between calls can reuse a cached prefix only
while the window over a long history keeps its first event: the window then starts at a
multiple of ``block`` events (``serve.requests.history_window``) and the tower reads between
``cap - block + 1`` and ``cap`` of the latest events instead of exactly ``cap``. This
evaluates a trained ML-1M HSTU checkpoint with its validation / test histories cut that way
(``data.eval_window_block``), per block, HR@10 / NDCG@10 beside block 1 (today's sliding
window), with each block's paired difference from block 1 over the same users.

The choice (``choose_block``): the largest block whose validation NDCG@10 is within
``--rel-tol`` (1%) of block 1's, every smaller block within it too. The test split is read
once, for block 1 and the chosen block. Only histories longer than the window change; the
JSON records the share of users whose history is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

NAME = "long_history"
KEYS = ("hr@10", "ndcg@10", "hr@50", "mrr")
DEFAULT_RUN = "runs/cfgc_temp007"  # the recipe of configs/hstu.toml on an 8-epoch schedule (notes)


# -- measuring ---------------------------------------------------------------------------------

def find_run(path: str | Path) -> Path:
    """A run directory (config.toml inside), or the newest one below ``path``."""
    path = Path(path)
    if (path / "config.toml").exists():
        return path
    runs = sorted(p.parent for p in path.glob("*/config.toml"))
    if not runs:
        raise FileNotFoundError(f"{path}: no run directory (config.toml) here or one level down")
    return runs[-1]


def recipe_check(job: Any, recipe: Any) -> dict[str, Any]:
    """Whether ``job`` is an ML-1M HSTU at the recipe's model (``configs/hstu.toml``): the
    fields that differ, by dotted name, so the JSON says what was evaluated."""
    from genrec.config import to_dict
    from genrec.train.runs.browse import config_differences

    skip = ("run.", "data.path", "embedding.tables", "train.progress", "train.threads", "train.evaluate",
            "train.checkpoint_every_steps", "train.keep_checkpoints", "train.log_every_steps")
    diff = {k: {"run": a, "recipe": b} for k, (a, b) in config_differences(to_dict(job), to_dict(recipe), skip).items()}
    ok = (Path(job.data.path).name == "ml1m" and job.model.tower == "hstu" and job.model.max_seq_len == 200
          and not any(k.startswith("model.") for k in diff))
    return {"ml1m_hstu_recipe_model": ok, "differences": diff}


def user_ranks(model: Any, reader: Any, cfg: Any) -> dict[int, int]:
    """{user id: 0-based rank of the target}, the evaluator's ranks (``train.evaluate``) kept per
    user so that two windows can be compared on the same users."""
    import torch

    from genrec.train.eval.evaluate import target_ranks

    out: dict[int, int] = {}
    corpus = model.corpus_ids
    with torch.no_grad():
        items = torch.cat([model.item_embeddings(corpus[i : i + cfg.item_chunk])
                           for i in range(0, corpus.numel(), cfg.item_chunk)])
        for batch in reader:
            scores = model.head.scores(model.user_embeddings(batch), items).float()
            seen = (batch.seen_ids, batch.seen_lengths) if cfg.exclude_history else (None, None)
            ranks = target_ranks(scores, batch.targets, corpus, *seen)
            out.update(zip(batch.user_ids.tolist(), ranks.tolist()))
    return out


def metrics_of(ranks: dict[int, int], users: list[int]) -> dict[str, float]:
    import torch

    from genrec.train.eval.evaluate import RankingMetrics

    m = RankingMetrics((10, 50), (10,))
    m.update(torch.tensor([ranks[u] for u in users]))
    return {k: v for k, v in m.compute().items() if k.split("_")[0] in (*KEYS, "users")}


def paired(ranks: dict[int, int], base: dict[int, int], users: list[int]) -> dict[str, float]:
    """Mean per-user NDCG@10 / HR@10 difference from ``base`` and its standard error."""
    out = {}
    for key, value in (("ndcg@10", lambda r: (r < 10) / math.log2(r + 2)), ("hr@10", lambda r: float(r < 10))):
        d = [value(ranks[u]) - value(base[u]) for u in users]
        mean = sum(d) / len(d)
        var = sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)
        out[f"{key}_diff"], out[f"{key}_diff_se"] = mean, math.sqrt(var / len(d))
    out["users_changed"] = sum(ranks[u] != base[u] for u in users)
    return out


def choose_block(rows: list[dict], rel_tol: float) -> int:
    """The largest block whose validation NDCG@10 is at least ``(1 - rel_tol)`` x block 1's,
    every smaller block's too (a noisy pass after a failure does not count)."""
    base = next(r for r in rows if r["block"] == 1)["valid"]["ndcg@10"]
    chosen = 1
    for r in sorted(rows, key=lambda r: r["block"]):
        if r["valid"]["ndcg@10"] < (1 - rel_tol) * base:
            break
        chosen = r["block"]
    return chosen


def history_shares(data: Path, cap: int, blocks: list[int], valid_users: float) -> dict[str, Any]:
    """Share of users whose validation (events[:-2]) and test (events[:-1]) histories are longer
    than the window, over every user and over the validation users; per block, the share whose
    window the block shortens and the mean events it drops there."""
    import numpy as np

    from genrec.train.data.files import read_interactions
    from genrec.train.data.reader import holds_valid
    from genrec.train.data.samples import window_start

    t = read_interactions(data, ["user_id", "item_ids"])
    users = t.column("user_id").to_numpy()
    n = np.diff(t.column("item_ids").combine_chunks().offsets.to_numpy())
    held = np.array([holds_valid(int(u), valid_users) for u in users])
    out: dict[str, Any] = {"users": int(users.size), "valid_users": int(held.sum()), "window": cap}
    for split, h, who in (("valid", n - 2, held), ("test", n - 1, np.ones_like(held))):
        out[f"{split}_longer_than_window"] = float((h[who] > cap).mean())
        out[f"all_users_{split}_longer_than_window"] = float((h > cap).mean())
        per = {}
        for b in blocks:
            dropped = np.array([window_start(int(x), cap, b) - window_start(int(x), cap) for x in h[who]])
            per[str(b)] = {"shortened": float((dropped > 0).mean()),
                           "mean_dropped_where_shortened": float(dropped[dropped > 0].mean()) if (dropped > 0).any() else 0.0}
        out[f"{split}_by_block"] = per
    return out


def measure(run: Path, data: Path, blocks: list[int], rel_tol: float, read_test: bool) -> dict[str, Any]:
    from dataclasses import replace

    from genrec.benchmarks.common import ROOT
    from genrec.quant.convert import load_training_model, resolve_checkpoint
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.evaluate import evaluate
    from genrec.train.job import load_job

    run_dir, ckpt = resolve_checkpoint(run)
    job, model = load_training_model(run_dir, ckpt)
    recipe = load_job(ROOT / "configs" / "hstu.toml")
    check = recipe_check(job, recipe)

    def ranks(split: str, block: int) -> dict[int, int]:
        cfg = replace(job.data, path=str(data), eval_window_block=block)
        return user_ranks(model, make_reader(cfg, split, job.embedding, job.model.max_seq_len), job.eval)

    valid = {b: ranks("valid", b) for b in blocks}
    users = sorted(valid[1])
    # the per-user ranks are the evaluator's: block 1 must read what train.evaluate reads
    whole = evaluate(model, make_reader(replace(job.data, path=str(data)), "valid", job.embedding,
                                        job.model.max_seq_len), job.eval)
    rows = [{"block": b, "valid": metrics_of(valid[b], users), "valid_vs_block_1": paired(valid[b], valid[1], users)}
            for b in blocks]
    if abs(rows[0]["valid"]["ndcg@10"] - whole["ndcg@10"]) > 1e-9:
        raise RuntimeError(f"per-user ranks read NDCG@10 {rows[0]['valid']['ndcg@10']}, the evaluator {whole['ndcg@10']}")
    chosen = choose_block(rows, rel_tol)
    test = {}
    if read_test:  # once, for today's window and the chosen one
        base = ranks("test", 1)
        tusers = sorted(base)
        test = {"1": metrics_of(base, tusers)}
        if chosen != 1:
            other = ranks("test", chosen)
            test[str(chosen)] = metrics_of(other, tusers) | {"vs_block_1": paired(other, base, tusers)}
    return {"run": str(run_dir), "checkpoint": ckpt.name, "config_check": check, "rows": rows,
            "rule": f"largest block with valid NDCG@10 >= (1 - {rel_tol:g}) x block 1's, every smaller block too",
            "rel_tol": rel_tol, "chosen_block": chosen, "test": test,
            "histories": history_shares(data, job.model.max_seq_len, blocks, job.data.valid_users)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=DEFAULT_RUN, help="trained ML-1M HSTU run dir (or a folder of runs: the newest)")
    ap.add_argument("--blocks", default="1,8,16,32,64", help="window blocks to evaluate (1 is always added)")
    ap.add_argument("--rel-tol", type=float, default=0.01, help="NDCG@10 loss the choice allows, relative")
    ap.add_argument("--no-test", action="store_true", help="validation only: do not read the test split")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    from genrec.benchmarks import report
    from genrec.benchmarks.common import dataset, machine, today, update_results_md, write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = sorted({1, *(int(b) for b in args.blocks.split(","))})
    out = measure(find_run(args.run), dataset("ml1m"), blocks, args.rel_tol, not args.no_test)
    payload = {"date": today(), "machine": machine(),
               "command": " ".join(["python -m genrec.benchmarks.long_history", *sys.argv[1:]]), **out}
    if args.no_test:
        print(json.dumps(payload, indent=2))
        return
    write_json(NAME, payload)
    if NAME in report.SECTIONS:  # the page renders this file once report.py knows it
        update_results_md()
    print("\n".join(long_history(payload)))


# -- rendering (RESULTS.md) --------------------------------------------------------------------

def long_history(d: dict) -> list[str]:
    """The RESULTS.md section of ``results/long_history.json``."""
    from genrec.benchmarks.long_bounded import section as bounded_section
    from genrec.benchmarks.report import MISSING, command, footer, get, num, table

    def pct(x: Any) -> Any:
        return x * 100 if isinstance(x, int | float) else None

    h = d.get("histories") or {}
    rows = []
    for r in d.get("rows", []):
        b = str(r.get("block"))
        rows.append([b + (" (chosen)" if r.get("block") == d.get("chosen_block") else ""),
                     num(get(r, "valid.hr@10")), num(get(r, "valid.ndcg@10")),
                     num(get(r, "valid_vs_block_1.ndcg@10_diff"), "+.4f") + " ± "
                     + num(get(r, "valid_vs_block_1.ndcg@10_diff_se"), ".4f"),
                     num(pct(get(h, f"valid_by_block.{b}.shortened")), ".1f", "%")])
    test = d.get("test") or {}
    trows = [[b, num(get(m, "hr@10")), num(get(m, "ndcg@10")),
              num(get(m, "vs_block_1.ndcg@10_diff"), "+.4f") + " ± " + num(get(m, "vs_block_1.ndcg@10_diff_se"), ".4f")
              if b != "1" else "-"] for b, m in sorted(test.items(), key=lambda kv: int(kv[0]))]
    cmd = command(d, "python -m genrec.benchmarks.long_history")
    users = get(h, "valid_users")
    diff = get(d, "config_check.differences") or {}
    differs = ", ".join(f"{k} {v.get('run')} (recipe {v.get('recipe')})" for k, v in diff.items()) or "nothing"
    return ["## Long histories: a history window that moves in blocks (ML-1M HSTU)", "",
            f"Anchor: block 1, today's window of the last {num(h.get('window'), 'd')} events. Block b: the "
            "window starts at a multiple of b, so a cached prefix survives new events and the tower reads "
            f"{num(h.get('window'), 'd')} - b + 1 to {num(h.get('window'), 'd')} events. Choice: "
            f"{d.get('rule', MISSING)}. Run `{d.get('run', MISSING)}` ({d.get('checkpoint', MISSING)}); "
            f"it differs from `configs/hstu.toml` in: {differs}.", "",
            f"Validation ({num(users, 'd')} users; {num(pct(h.get('valid_longer_than_window')), '.1f', '%')} of them, "
            f"{num(pct(h.get('all_users_valid_longer_than_window')), '.1f', '%')} of all users, have a history "
            "longer than the window):", "",
            *table(["block", "HR@10", "NDCG@10", "NDCG@10 vs block 1 (paired)", "windows shortened"], rows), "",
            "Test, read once for block 1 and the chosen block:", "",
            *table(["block", "HR@10", "NDCG@10", "NDCG@10 vs block 1 (paired)"], trows), *footer(d, cmd),
            *bounded_section(d.get("bounded") or {})]


def long_history_summary(d: dict) -> tuple[str, str]:
    """(headline, anchor) of the page's table at the top."""
    from genrec.benchmarks.report import get, num

    b = d.get("chosen_block")
    test = d.get("test") or {}
    chosen, base = test.get(str(b), {}), test.get("1", {})
    return (f"window block {num(b, 'd')}: test NDCG@10 {num(get(chosen, 'ndcg@10'))} "
            f"(paired {num(get(chosen, 'vs_block_1.ndcg@10_diff'), '+.4f')})",
            f"block 1 (sliding window) {num(get(base, 'ndcg@10'))}")


if __name__ == "__main__":
    main()
