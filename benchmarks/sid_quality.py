"""Generative retrieval quality: the semantic-ID decoder beside dense retrieval (issue 33).

    python -m genrec.benchmarks.sid_quality --dataset beauty --dense-budget-min 20 --budget-min 40

Per dataset: a dense HSTU run (configs/hstu.toml, or ``--dense-run``) gives the item vectors
-> ``genrec sid build`` (RQ-KMeans) -> a configs/sid.toml run started from the dense run
(``train.init_from``; its checkpoint chosen on validation ``gen_ndcg@10``) -> on the test split,
read once: the decoded ranking's HR / NDCG / MRR beside the same run's dense head, the share of
decoded items that exist (and are not in the history), and recall@100 of the held-out item for
dense top-100 against dense top-100 merged with the decoded top-50 (and, at the merged list's
size, dense top-150). Both trainings' minutes are recorded: their sum is the training budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from genrec.benchmarks.common import RESULTS, dataset, machine, today, update_results_md, write_json

ANCHORS = {
    "beauty": [("SASRec (TIGER paper)", 0.0605, 0.0318), ("TIGER (paper)", 0.0648, 0.0384)],
    "ml1m": [("SASRec (HSTU paper)", 0.2853, 0.1603), ("HSTU (paper)", 0.3097, 0.1720)],
}
KEYS = ("hr@10", "ndcg@10", "hr@50", "mrr")


def train(config: str, overrides: list[str]) -> tuple[Path, dict]:
    from genrec.train.job import load_job
    from genrec.train.loop.launch import run_training

    return run_training(load_job(config, overrides))


def build_codebook(dense_run: Path, out: Path, levels: tuple[int, ...], seed: int = 0) -> dict:
    from genrec.models.sid import build_semantic_ids
    from genrec.train.loop.checkpoint import resolve_checkpoint
    from genrec.train.sid_build import load_item_vectors, write

    run_dir, checkpoint = resolve_checkpoint(dense_run)
    ids, vectors = load_item_vectors(run_dir, checkpoint)
    t0 = time.perf_counter()
    sid = build_semantic_ids(ids, vectors, sizes=levels, seed=seed)
    seconds = time.perf_counter() - t0
    write(sid, out, {"checkpoint": str(checkpoint), "levels": list(levels), "seed": seed})
    return {**sid.stats(), "build_seconds": round(seconds, 1)}


ITEM_CHUNK = 1 << 18  # catalogue rows scored at a time: a [B, chunk] float32 block (128 MB at B = 128)


def chunked_topk(user: torch.Tensor, items: torch.Tensor, corpus: torch.Tensor, seen_ids: torch.Tensor,
                 seen_lengths: torch.Tensor, k: int, chunk: int = ITEM_CHUNK) -> torch.Tensor:
    """Exact top-``k`` catalogue ids per user by dot product, the history left out, without a
    [B, N] matrix: user [B, D], items [N, D] (rows of the sorted ``corpus`` [N]), seen_ids [E]
    with seen_lengths [B] -> ids [B, k], best first. Each block of ``chunk`` items keeps its
    own top-k and the running top-k merges them: the same list as one ``topk`` over [B, N]
    (ties aside), in O(B * chunk) memory."""
    from genrec.quant.ann import blockwise_top
    from genrec.train.eval.evaluate import mask_seen

    def scores(s: int, e: int) -> torch.Tensor:
        return mask_seen(user @ items[s:e].T, corpus[s:e], seen_ids, seen_lengths)

    return corpus[blockwise_top(scores, corpus.numel(), k, chunk)]


def user_sample(num_users: int, max_users: int | None) -> int:
    """How many interleaved slices the split's users are cut into so that the first holds at
    most ``max_users`` (every ``stride``-th user of the file: a deterministic sample); 1: all."""
    return 1 if not max_users or num_users <= max_users else -(-num_users // max_users)


@torch.no_grad()
def merged_recall(run_dir: Path, dense_k: int = 100, gen_k: int = 50, max_users: int | None = None,
                  split: str = "test", chunk: int = ITEM_CHUNK) -> dict:
    """Recall of the held-out ``split`` item: dense top-``dense_k``; decoded top-``gen_k``; their
    union; dense top-(dense_k + gen_k) (a dense list as long as the union can be); and the
    share of decoded items that are catalogue items outside the user's history.

    The dense lists are exact (every catalogue item scored) in blocks of ``chunk`` items
    (:func:`chunked_topk`), so a 10^7-item catalogue needs no [B, N] matrix. ``max_users``:
    at most that many users, every ``stride``-th of the split's file (deterministic); None:
    all of them."""
    from genrec.train.cli import load_run_model
    from genrec.train.data.reader import make_reader

    job, model, emb, _ = load_run_model(run_dir, None, None)
    model.eval()
    corpus = model.corpus_ids
    items = torch.empty(corpus.numel(), job.embedding.item_table.dim)
    for i in range(0, corpus.numel(), chunk):
        items[i : i + chunk] = model.item_embeddings(corpus[i : i + chunk]).float()
    reader = make_reader(job.data, split, emb, job.model.max_seq_len)  # type: ignore[arg-type]
    # the valid split holds data.valid_users of the users (a hash of the id): about that share of the rows
    share = job.data.valid_users if split == "valid" else 1.0
    stride = user_sample(round(reader.num_rows * share), max_users)
    if stride > 1:
        reader = make_reader(job.data, split, emb, job.model.max_seq_len, rank=0, world_size=stride)  # type: ignore[arg-type]
    hits = {"dense": 0, "generative": 0, "merged": 0, "dense_long": 0}
    users = decoded = valid = 0
    for batch in reader:
        states = model.user_states(batch)
        user = model.head.normalize(states.float()).float()
        dense = chunked_topk(user, items, corpus, batch.seen_ids, batch.seen_lengths, dense_k + gen_k, chunk)
        beams, _ = model.sid_head.beam_search(states, gen_k, (batch.seen_ids, batch.seen_lengths))
        t = batch.targets[:, None]
        hits["dense"] += int((dense[:, :dense_k] == t).any(1).sum())
        hits["dense_long"] += int((dense == t).any(1).sum())
        hits["generative"] += int((beams == t).any(1).sum())
        hits["merged"] += int(((dense[:, :dense_k] == t).any(1) | (beams == t).any(1)).sum())
        real = beams >= 0
        pos = torch.searchsorted(corpus, beams.clamp(min=0)).clamp(max=corpus.numel() - 1)
        in_catalogue = real & (corpus[pos] == beams)
        seen = torch.zeros_like(real)
        for u, row in enumerate(torch.split(batch.seen_ids, batch.seen_lengths.tolist())):
            seen[u] = torch.isin(beams[u], row)
        decoded += int(real.sum())
        valid += int((in_catalogue & ~seen).sum())
        users += beams.shape[0]
    return {"users": users, "user_stride": stride, "split": split, "catalogue": corpus.numel(),
            f"dense_recall@{dense_k}": hits["dense"] / users,
            f"generative_recall@{gen_k}": hits["generative"] / users,
            f"merged_recall@{dense_k}+{gen_k}": hits["merged"] / users,
            f"dense_recall@{dense_k + gen_k}": hits["dense_long"] / users,
            "decoded_items": decoded, "valid_share": valid / max(decoded, 1)}


def reevaluate(name: str, run_dir: Path) -> None:
    """The run's chosen checkpoint decoded again: validation first (printed beside what training
    recorded at that checkpoint), then the test split and merged recall, into its record."""
    from genrec.train.cli import evaluate_run

    res = json.loads((run_dir / "results.json").read_text())
    recorded = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at_best = [r for r in recorded if r.get("kind") == "eval" and r.get("split") == "valid"
               and r.get("step") == res.get("best_step")]
    valid, _ = evaluate_run(run_dir, None, "valid")
    print("valid now:", {k: round(valid[f"gen_{k}"], 4) for k in KEYS},
          "recorded:", {k: round(at_best[-1][f"gen_{k}"], 4) for k in KEYS} if at_best else None)
    test, _ = evaluate_run(run_dir, None, "test")
    path = RESULTS / "sid_quality.json"
    records = json.loads(path.read_text())["records"]
    for r in records:
        if r["dataset"] == name:
            r.update(generative={k: test[f"gen_{k}"] for k in KEYS}, dense_head={k: test[k] for k in KEYS},
                     merged=merged_recall(run_dir), date=today(), machine=machine(),
                     valid_generative={k: valid[f"gen_{k}"] for k in KEYS},
                     reevaluated="python -m genrec.benchmarks.sid_quality " + " ".join(sys.argv[1:]))
    write_json("sid_quality", {"records": records})
    update_results_md()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="beauty", choices=sorted(ANCHORS))
    ap.add_argument("--dense-run", help="a finished dense run to build the codebook from (else one is trained)")
    ap.add_argument("--dense-budget-min", type=float, default=20.0)
    ap.add_argument("--dense-epochs", type=int, default=10, help="the dense run's cosine schedule length")
    ap.add_argument("--budget-min", type=float, default=40.0, help="the generative run's time budget")
    ap.add_argument("--epochs", type=int, default=20, help="the generative run's cosine schedule length")
    ap.add_argument("--levels", default="256,256,256")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out-dir", default="runs/benchmarks/sid")
    ap.add_argument("--eval-run", help="a finished generative run: evaluate it again (validation beside what its "
                    "training recorded, then the test split and the merged recall) instead of training; for a "
                    "change of the decoding, not of the model")
    args = ap.parse_args()
    if args.eval_run:
        reevaluate(args.dataset, Path(args.eval_run))
        return
    data = dataset(args.dataset)
    common = [f'--data.path="{data}"', f'--run.out_dir="{args.out_dir}"'] + (
        [f"--train.threads={args.threads}"] if args.threads else [])
    dense_minutes = None
    if args.dense_run:
        dense_run = Path(args.dense_run)
    else:
        dense_run, res = train("hstu", common + [f"--run.name={args.dataset}_dense",
                                                 f"--train.time_budget_min={args.dense_budget_min}",
                                                 f"--train.max_epochs={args.dense_epochs}"])
        dense_minutes = res["train_seconds"] / 60
    if dense_minutes is None:
        dense_minutes = json.loads((dense_run / "results.json").read_text())["train_seconds"] / 60
    book = Path(args.out_dir) / f"{args.dataset}_codebook.safetensors"
    stats = build_codebook(dense_run, book, tuple(int(x) for x in args.levels.split(",")))
    run_dir, res = train("sid", common + [f"--run.name={args.dataset}_sid", f'--model.sid.codebook="{book}"',
                                          f'--train.init_from="{dense_run}"',
                                          f"--train.time_budget_min={args.budget_min}",
                                          f"--train.max_epochs={args.epochs}"])
    test = res["test"]
    record = {
        "dataset": args.dataset, "date": today(), "machine": machine(),
        "generative": {k: test[f"gen_{k}"] for k in KEYS}, "dense_head": {k: test[k] for k in KEYS},
        "codebook": stats, "merged": merged_recall(run_dir),
        "dense_minutes": round(dense_minutes, 1), "generative_minutes": round(res["train_seconds"] / 60, 1),
        "epochs": res["epochs"], "best_epoch": res["best_epoch"], "beam_width": 50,
        "dense_run": str(dense_run), "run_dir": str(run_dir), "levels": args.levels,
        "command": "python -m genrec.benchmarks.sid_quality " + " ".join(sys.argv[1:]),
        "anchors": ANCHORS[args.dataset],
    }
    path = RESULTS / "sid_quality.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    records = [r for r in records if r["dataset"] != args.dataset] + [record]
    write_json("sid_quality", {"records": records})
    update_results_md()
    print(json.dumps({k: record[k] for k in ("dataset", "generative", "dense_head", "merged")}, indent=1))


def sid_quality(d: dict) -> list[str]:
    from genrec.benchmarks.report import machine_text, num, table

    out = ["## Generative retrieval (semantic IDs, trie-constrained beam, test split)", "",
           "Anchor: TIGER (Beauty) and SASRec (ML-1M), published, same protocol (leave-one-out, full "
           "catalogue). Test split, read once, at the checkpoint chosen on validation gen_ndcg@10.", ""]
    for r in d["records"]:
        g, h, m, c = r["generative"], r["dense_head"], r["merged"], r["codebook"]
        out += [f"### {r['dataset']}", ""]
        rows = [["generative (semantic IDs, beam 50)", *(num(g[k]) for k in KEYS)],
                ["dense head of the same run", *(num(h[k]) for k in KEYS)]]
        rows += [[f"*{name}*", num(hr), num(nd), "", ""] for name, hr, nd in r["anchors"]]
        out += table(["model", *KEYS], rows) + [""]
        out.append(f"Training: dense {r['dense_minutes']} min + generative {r['generative_minutes']} min "
                   f"({r['epochs']} epochs, best {r['best_epoch']}). Codebook {'x'.join(map(str, c['sizes']))}: "
                   f"collision rate {c['collision_rate']:.1%}, codes used per level "
                   f"{', '.join(f'{u:.0%}' for u in c['used_per_level'])}. Decoded items valid (in the catalogue, "
                   f"not in the history): {m['valid_share']:.2%} of {m['decoded_items']}.")
        keys = [k for k in m if "recall" in k]
        out += [""] + table(["recall of the test item", *keys], [["", *(num(m[k]) for k in keys)]])
        out += ["", f"Codebook and start: {r['dense_run']}.", "",
                f"Machine: {machine_text(r['machine'])}; {r['date']}. Command: `{r.get('command', '')}`.", ""]
    out.append("Recall: of the held-out test item in each list (history excluded); merged = the dense top-100 and the "
               "decoded top-50, deduplicated; dense@150: a dense list as long as the merged one can be.")
    return out


def sid_quality_summary(d: dict) -> tuple[str, str]:
    parts = [f"{r['dataset']} HR@10 {r['generative']['hr@10']:.4f} / NDCG@10 "
             f"{r['generative']['ndcg@10']:.4f}, recall@100 {r['merged']['dense_recall@100']:.3f} dense, "
             f"{r['merged']['merged_recall@100+50']:.3f} merged"
             for r in d["records"]]
    return "; ".join(parts), "TIGER (paper) 0.0648 / 0.0384"


if __name__ == "__main__":
    main()
