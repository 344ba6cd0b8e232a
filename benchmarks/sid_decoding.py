"""Semantic-ID decoding latency: the SGLang engine's beams against the PyTorch reference (issues 33, 42).

    python -m genrec.benchmarks.sid_decoding                       # a tiny synthetic artifact
    python -m genrec.benchmarks.sid_decoding --run RUN_DIR         # a trained model.sid run (exported fp32)
    python -m genrec.benchmarks.sid_decoding --artifact ARTIFACT   # a served artifact with a decoder

Per beam width (10, 20, 50), one request at a time, the two engines side by side on the same
requests (one torch call, then one SGLang call, so both see the same machine load):

* ``decode``: generative retrieval from a given user vector: ``TorchEngine.generate`` (the
  decoder's ``beam_search``) against ``SGLangEngine.generate`` (one SGLang request carrying the
  vector; the model runs the same ``beam_search`` in its forward, in SGLang's scheduler);
* ``retrieve``: a whole Retrieve with ``source = GENERATIVE`` through ``run`` (history window ->
  tower -> user vector -> beam), the user's second call (SGLang: the history from its radix cache);

plus whether the answers agree (items equal, largest log-probability difference), whether every
item is a catalogue item outside the request's exclusions, and the SGLang engine's floor: the
same decode call at beam 1 (SGLang's request path and a near-empty forward).
Writes benchmarks/results/sid_decoding.json and RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from genrec.benchmarks.common import machine, shown_path, today, update_results_md, write_json

BEAMS = (10, 20, 50)
T0 = 1_700_000_000


def tiny_artifact(out: Path) -> Path:
    """A tiny HSTU retrieval model with a decoder, trained one epoch on synthetic data: a dense
    run's item vectors -> a 16 x 16 codebook (+ a collision level) -> a model.sid run -> fp32."""
    from genrec.models.sid import build_semantic_ids
    from genrec.quant.convert import QuantizeConfig, export, load_training_model, resolve_checkpoint
    from genrec.train.data.synthetic import SyntheticConfig, generate
    from genrec.train.job import load_job
    from genrec.train.loop.launch import run_training

    data = out / "data"
    generate(SyntheticConfig(num_users=300, num_items=600, num_topics=8, median_len=12, max_len=60, seed=3,
                             chunk_users=128), data, progress=False)
    cfg = out / "tiny.toml"
    cfg.write_text('[[embedding.tables]]\nname = "item"\nfeatures = ["item"]\ndim = 32\n')
    common = [f'--data.path="{data}"', "--data.batch_size=32", "--model.max_seq_len=64", "--model.hstu.qk_dim=32",
              "--model.hstu.v_dim=32", "--model.retrieval.num_negatives=32", "--train.progress=false",
              "--train.max_epochs=1", f'--run.out_dir="{out / "runs"}"']
    dense, _ = run_training(load_job(cfg, common + ["--run.name=dense"]))
    _, model = load_training_model(*resolve_checkpoint(dense))
    with torch.no_grad():
        vectors = model.item_embeddings(model.corpus_ids)
    book = out / "sid.safetensors"
    build_semantic_ids(model.corpus_ids, vectors, sizes=(16, 16), iters=10).save(book)
    run, _ = run_training(load_job(cfg, common + ["--run.name=sid", "--model.sid.enabled=true",
                                                   f'--model.sid.codebook="{book}"']))
    art = out / "artifact"
    export(run, art, QuantizeConfig(), progress=False, measure_accuracy=False)
    return art


def exported(run: Path, out: Path) -> Path:
    from genrec.quant.convert import QuantizeConfig, export

    art = out / "artifact"
    export(run, art, QuantizeConfig(), progress=False, measure_accuracy=False)
    return art


def works(engine, n: int, beam: int, seed: int) -> list:  # noqa: ANN001
    """``n`` generative Retrieve works (k = beam) of users with histories drawn from the catalogue."""
    from genrec.loadtest.client import user
    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.serve.requests import Limits, decode

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(5, engine.schema.max_history + 1))
        items = rng.choice(engine.corpus_np, length)
        action = 1 if engine.schema.num_actions else 0
        u = user([(int(it), T0 + 90 * j, action) for j, it in enumerate(items)], {})
        u.user_id = f"b{beam}-{i}"
        req = pb.RetrieveRequest(user=u, k=beam, source=pb.RETRIEVAL_SOURCE_GENERATIVE, beam=beam)
        out.append(decode("retrieve", req.SerializeToString(), engine.schema, Limits(max_beam=max(BEAMS))))
    return out


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p99_ms": round(float(np.percentile(a, 99)), 2),
            "mean_ms": round(float(a.mean()), 2), "n": int(a.size)}


def timed(fn, *args) -> tuple[float, object]:  # noqa: ANN001
    t = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - t) * 1e3, out


def compare(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[bool, float]:
    same = a[0].shape == b[0].shape and bool((a[0] == b[0]).all())
    return same, float(np.abs(a[1] - b[1]).max()) if same and a[1].size else 0.0


def floor(se, users: torch.Tensor, ws: list) -> dict:  # noqa: ANN001
    """The SGLang engine's decode at beam 1 (its request path and a near-empty forward)."""
    ms = [timed(se.generate, users[i : i + 1], [(0, dataclasses.replace(w, beam=1))])[0] for i, w in enumerate(ws)]
    return stats(ms)


def bench_beam(te, se, beam: int, n: int) -> dict:  # noqa: ANN001
    ws = works(te, n, beam, seed=beam)
    with torch.inference_mode():
        users = te.packed.encode([w.user for w in ws])[0] if te.packed is not None else None
    times = {"torch": {"decode": [], "retrieve": []}, "sglang": {"decode": [], "retrieve": []}}
    agree, worst, valid, excluded, returned = 0, 0.0, 0, 0, 0
    for w in ws:  # first calls: prime SGLang's cache with each user's history (and both engines' code paths)
        se.run([w])
    for i, w in enumerate(ws):
        vec = users[i : i + 1]
        ms_t, ref = timed(te.generate, vec, [(0, w)])
        ms_s, got = timed(se.generate, vec, [(0, w)])
        times["torch"]["decode"].append(ms_t)
        times["sglang"]["decode"].append(ms_s)
        same, diff = compare(ref[0], got[0])
        agree, worst = agree + same, max(worst, diff)
        items = got[0][0]
        returned += items.size
        valid += int(np.isin(items, te.corpus_np).sum())
        excluded += int(np.isin(items, w.excluded()).sum())
        ms_t, _ = timed(te.run, [w])
        ms_s, _ = timed(se.run, [w])
        times["torch"]["retrieve"].append(ms_t)
        times["sglang"]["retrieve"].append(ms_s)
    out = {eng: {mode: stats(v) for mode, v in modes.items()} for eng, modes in times.items()}
    return {**out, "requests": n, "same_items": agree, "max_abs_logp_diff": worst, "items_returned": returned,
            "valid_item_share": valid / max(returned, 1), "excluded_returned": excluded,
            "sglang_over_torch_decode_p50": round(out["sglang"]["decode"]["p50_ms"] / out["torch"]["decode"]["p50_ms"], 2),
            "sglang_beam1_decode": floor(se, users, ws[:10])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--artifact", type=Path, help="a served artifact with a semantic-ID decoder")
    src.add_argument("--run", type=Path, help="a trained run with model.sid (exported to fp32 first)")
    ap.add_argument("--requests", type=int, default=40, help="requests per beam width (default: %(default)s)")
    ap.add_argument("--beams", type=int, nargs="+", default=list(BEAMS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process and SGLang's model")
    ap.add_argument("--label", default="", help="what the artifact is, for the report (default: its path)")
    ap.add_argument("--json", type=Path, help="write the figures here instead of results/ (RESULTS.md untouched)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from genrec.serve.engine import TorchEngine
    from genrec.serve.sglang_engine import SGLangEngine

    tmp = Path(tempfile.mkdtemp(prefix="sid-decoding-"))
    art = args.artifact or (exported(args.run, tmp) if args.run else tiny_artifact(tmp))
    te = TorchEngine(art)
    head = te.model.sid_head
    if head is None:
        raise SystemExit(f"{art}: the model has no semantic-ID decoder (model.sid)")
    se = SGLangEngine(art, pool_tokens=65536, threads=args.threads, max_beam=max(args.beams))
    try:
        results = {str(b): bench_beam(te, se, b, args.requests) for b in args.beams}
    finally:
        se.close()
    cmd = "python -m genrec.benchmarks.sid_decoding" + (f" --artifact {shown_path(args.artifact)}" if args.artifact else "") + (
        f" --run {shown_path(args.run)}" if args.run else "") + (f" --requests {args.requests}" if args.requests != 40 else "") + (
        f" --beams {' '.join(map(str, args.beams))}" if args.beams != list(BEAMS) else "") + (
        f" --label '{args.label}'" if args.label else "")
    payload = {"date": today(), "machine": machine(), "command": cmd,
               "artifact": {"tiny": not (args.artifact or args.run),
                            "source": shown_path(args.run or args.artifact) if args.run or args.artifact else "synthetic",
                            "label": args.label,
                            "levels": head.levels, "sizes": list(head.sizes), "items": int(head.sid.item_ids.numel()),
                            "decoder_layers": len(head.blocks), "dim": int(head.norm.normalized_shape[0]),
                            "max_history": te.schema.max_history},
               "mechanism": "one SGLang request per work; SIDDecoder.beam_search in the model's forward "
                            "(SGLang's scheduler)",
               "threads": args.threads, "beams": results}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    else:
        write_json("sid_decoding", payload)
        update_results_md()
    for b, r in results.items():
        print(f"beam {b}: decode p50 torch {r['torch']['decode']['p50_ms']} ms, sglang {r['sglang']['decode']['p50_ms']} ms; "
              f"retrieve p50 torch {r['torch']['retrieve']['p50_ms']} ms, sglang {r['sglang']['retrieve']['p50_ms']} ms; "
              f"same items {r['same_items']}/{r['requests']}")


def sid_decoding(d: dict) -> list[str]:
    """RESULTS.md section (benchmarks/report.py calls it lazily)."""
    from genrec.benchmarks.report import command, footer, get, num, table

    a = d.get("artifact", {})
    rows = []
    for beam, r in d.get("beams", {}).items():
        for mode in ("decode", "retrieve"):
            rows.append([beam, mode, *(f"{num(get(r, f'{e}.{mode}.p50_ms'), '.1f')} / {num(get(r, f'{e}.{mode}.p99_ms'), '.1f')}"
                                       for e in ("torch", "sglang")),
                         f"{num(get(r, 'same_items'), 'd')}/{num(get(r, 'requests'), 'd')}" if mode == "decode" else "",
                         num(get(r, "max_abs_logp_diff"), ".1e") if mode == "decode" else "",
                         num(get(r, "valid_item_share"), ".3f") if mode == "decode" else "",
                         num(get(r, "sglang_beam1_decode.p50_ms"), ".1f") if mode == "decode" else ""])
    kind = ("a tiny synthetic artifact (not a trained model's figures)" if a.get("tiny")
            else a.get("label") or f"`{a.get('source')}`")
    return ["## Semantic-ID decoding: the SGLang engine against the PyTorch reference", "",
            "Anchor: the PyTorch reference (`SIDDecoder.beam_search` through `TorchEngine.generate`) on the same "
            "requests, one at a time; answers must agree and every item must exist.", "",
            f"Model: {kind}; {num(a.get('levels'), 'd')} levels of sizes {a.get('sizes')}, "
            f"{num(a.get('items'), 'd')} items, decoder {num(a.get('decoder_layers'), 'd')} layers of "
            f"{num(a.get('dim'), 'd')}.", "",
            *table(["beam", "call", "torch p50 / p99 ms", "SGLang p50 / p99 ms", "same items", "max abs dlogp",
                    "items valid", "SGLang beam 1 p50 ms"], rows), "",
            "decode: from a user vector (generate); retrieve: a whole generative Retrieve, the history cached. "
            "SGLang decodes in its model's forward (one request per work); the last column is its floor, the "
            "same call at beam 1.", *footer(d, command(d, "python -m genrec.benchmarks.sid_decoding"))]


def sid_decoding_summary(d: dict) -> tuple[str, str]:
    from genrec.benchmarks.report import get, num

    b = d.get("beams", {})
    beam = "50" if "50" in b else (sorted(b, key=int)[-1] if b else "50")
    tiny = " (tiny model)" if get(d, "artifact.tiny") else ""
    return (f"beam {beam}: SGLang decode p50 {num(get(b, f'{beam}.sglang.decode.p50_ms'), '.1f')} ms, torch "
            f"{num(get(b, f'{beam}.torch.decode.p50_ms'), '.1f')} ms; same items "
            f"{num(get(b, f'{beam}.same_items'), 'd')}/{num(get(b, f'{beam}.requests'), 'd')}{tiny}",
            "the PyTorch reference beam: equal items and log-probabilities, 100% valid items")


if __name__ == "__main__":
    main()
