"""The sections of the benchmarks that ``report.py`` renders itself (newer benchmarks keep
their renderer beside them): each a pure function of one results JSON to the lines of its
full section in DETAILS.md, ``## title`` first; RESULTS.md shows one table of it
(``report_headlines.py``)."""

from __future__ import annotations

from typing import Any

from genrec.benchmarks.report_format import MISSING, command, footer, get, machine_text, num, table

# Anchors that the JSON files do not carry. Published: "Actions Speak Louder than Words"
# (HSTU, ICML 2024, Table 4) and TIGER (NeurIPS 2023), the protocol of ../shared/data/README.md.
PUBLISHED = {
    "ml1m": [("SASRec (HSTU paper)", 0.2853, 0.1603), ("HSTU (paper)", 0.3097, 0.1720),
             ("HSTU-large (paper)", 0.3294, 0.1893)],
    "beauty": [("SASRec (TIGER paper)", 0.0605, 0.0318), ("TIGER (paper)", 0.0648, 0.0384)],
}
MODEL_ORDER = {"popular baseline": 0, "transition baseline": 1, "transformer": 2, "hstu": 3}
QUANT_GOALS = {"int8": (0.30, 0.01), "int4": (0.17, 0.03)}  # table bytes x fp32, relative NDCG@10 loss
SERVING_GOAL_QPS = 300  # within the JSON's p99 budget, and at least 2x the naive server
# a load step whose sender ran later than this (p99) did not offer its load on time: the one-core
# Python generator, not only the server, set its figures (benchmarks/notes/2026-12-05-resilience-generator.md)
GENERATOR_LATE_MS = 10.0
RESILIENCE_TARGETS = ("goodput >= 0.9x capacity at 4x offered, refusals within 5 ms, admitted p99 "
                      "within 2x the budget; at 8x >= 0.8x, p99 back within 2 s; a quiet caller's p99 beside "
                      "a 4x flood within 1.5x of its own; engine SIGKILL at 50% load: <= 1% of calls failed, none "
                      "after 1 s; SIGTERM: exit within the grace period, no call left hanging")


def quality(d: dict) -> list[str]:
    latest: dict[tuple, dict] = {}
    for r in d.get("records", []):  # one row per (dataset, model): the newest supersedes the rest
        key = (r.get("dataset"), r.get("model"))
        if key not in latest or str(r.get("date", "")) >= str(latest[key].get("date", "")):
            latest[key] = r
    machines: list[str] = []
    out = ["## Retrieval quality (leave-one-out, full-corpus ranking, test split)", "",
           "Anchor: the published figures under the same protocol (italic rows). Test at the "
           "checkpoint chosen on validation (`train.early_stop_metric`).", ""]
    for ds in sorted({k[0] for k in latest}, key=lambda s: (s != "ml1m", str(s))):
        rows = []
        for (dset, model), r in sorted(latest.items(), key=lambda kv: (MODEL_ORDER.get(kv[0][1], 9), str(kv[0]))):
            if dset != ds:
                continue
            m = machine_text(r.get("machine"))
            if m not in machines:
                machines.append(m)
            procs = r.get("processes", 1)
            name = model if procs == 1 else f"{model} ({procs} processes)"
            rows.append([name, num(r.get("hr@10")), num(r.get("ndcg@10")), num(r.get("hr@50")),
                         num(r.get("mrr")), num(r.get("epochs"), "d"), str(r.get("date", MISSING)),
                         f"[{machines.index(m) + 1}]"])
        rows += [[f"*{label}*", f"{hr:.4f}", f"{ndcg:.4f}", "", "", "", "published", ""]
                 for label, hr, ndcg in PUBLISHED.get(ds, [])]
        out += [f"### {ds}", "", *table(["model", "HR@10", "NDCG@10", "HR@50", "MRR", "epochs",
                                          "date", "machine"], rows), ""]
    out += [f"Machines: {'; '.join(f'[{i + 1}] {m}' for i, m in enumerate(machines))}.",
            "Command: `python -m genrec.benchmarks.quality --datasets ml1m,beauty` "
            "(the two-process rows: `--models hstu --no-baselines --nproc 2`)."]
    return out


def train_speed(d: dict) -> list[str]:
    rows = [[name, num(get(v, "naive_padded_eager.s_per_step"), ".3f"), num(get(v, "default.s_per_step"), ".3f"),
             num(v.get("speedup"), ".2f", "x"), num(v.get("speedup_same_matmul_precision"), ".2f", "x")]
            for name, v in sorted(d.get("variants", {}).items())]
    cmd = command(d, f"python -m genrec.benchmarks.train_speed --steps {d.get('steps_per_round', 20)} "
                     f"--rounds {d.get('rounds', 3)}")
    return ["## Training throughput (ML-1M HSTU step, shipped path vs naive padded eager)", "",
            f"Anchor: goal {num(d.get('goal'), '.1f', 'x')} the naive step. "
            f"Config `{d.get('config', MISSING)}`, batch {num(d.get('batch_size'), 'd')}.", "",
            *table(["loss head", "naive s/step", "shipped s/step", "speed-up",
                    "speed-up at the same matmul precision"], rows), *footer(d, cmd)]


def kernels(d: dict) -> list[str]:
    rows = [[path, num(ms, ".1f"), num(get(d, f"attention.gflop_per_s.{path}"), ".0f"),
             num(get(d, f"attention.speedup_vs_reference.{path}"), ".2f", "x")]
            for path, ms in sorted(get(d, "attention.ms").items())] if get(d, "attention.ms") else []
    shape = get(d, "attention.shape") or {}
    steps = [[name, num(v.get("s_per_step"), ".3f"), num(v.get("sequences_per_s"), ".0f")]
             for name, v in sorted((get(d, "train_step") or {}).items()) if isinstance(v, dict)]
    dev = d.get("device", "cpu")
    cmd = command(d, "python -m genrec.benchmarks.kernels" + ("" if dev == "cpu" else f" --device {dev}"))
    return [f"## Kernels ({dev}): HSTU attention forward + backward", "",
            f"Anchor: the pure-PyTorch reference (1.00x). An ML-1M batch of 128 users, {shape.get('heads', MISSING)} head(s) of "
            f"{shape.get('dqk', shape.get('dim', MISSING))}; GFLOP/s over the causal triangle's GEMMs.", "",
            *table(["path", "ms", "GFLOP/s", "vs reference"], rows), "",
            *table(["training step", "s/step", "sequences/s"], steps), *footer(d, cmd)]


def _calibration(by: dict, variant: str, task: str) -> str:
    """NE and ECE of a ranking record's test split, calibrated (uncalibrated), and the ECE floor."""
    def f(k: str, fmt: str = ".4f") -> str:
        return num(get(by, f"{variant}.test.{task}/{k}"), fmt)

    if get(by, f"{variant}.test.{task}/ece_floor") is None:  # a record from before calibration
        return f"NE {f('ne', '.3f')}"
    return (f"NE {f('ne', '.3f')} ({f('ne_uncalibrated', '.3f')}), ECE {f('ece')} ({f('ece_uncalibrated')}), "
            f"floor {f('ece_floor')}")


def _former_rule(ds: str, by: dict) -> str:
    """A note on retrieval figures measured before the evaluation matched serving (records
    without ``retrieval_rule``): on logs with repeated targets (the synthetic ones) they
    counted those targets as hits."""
    if ds != "synthetic" or all(get(by, f"{v}.retrieval_rule") == "served" for v in ("joint", "retrieval-only")):
        return ""
    return "; former rule: repeated targets counted as hits, see the evaluation-as-served section"


def ranking(d: dict) -> list[str]:
    recs = d.get("records", [])
    out = ["## Ranking (multi-task, held-out time split)", "",
           "Anchors: the pooled DLRM baseline on the same batches, the true-probability oracle's "
           "AUC (synthetic data; what the shown histories allow is in the ceilings section), and the "
           "retrieval-only model for the joint model's retrieval. Probabilities as served: isotonic "
           "calibration fitted on validation; NE and ECE on the test split, ECE beside its floor "
           "(what a perfectly calibrated model shows on as many candidates), uncalibrated NE / ECE "
           "in brackets.", ""]
    for ds in sorted({r.get("dataset") for r in recs}, key=str):
        by = {r.get("variant"): r for r in recs if r.get("dataset") == ds}
        tasks = sorted({k.split("/")[0] for r in by.values() for k in r.get("test", {}) if k.endswith("/auc")})
        rows = []
        for t in tasks:
            oracle = get(by, f"joint.test.{t}/oracle_auc")
            rows.append([t, num(get(by, f"joint.test.{t}/auc")), num(get(by, f"dlrm.test.{t}/auc")),
                         num(oracle) if oracle is not None else "-", _calibration(by, "joint", t),
                         _calibration(by, "dlrm", t)])
        first = by.get("joint", next(iter(by.values()), {}))
        out += [f"### {ds}", "", *table(["task", "joint AUC", "DLRM AUC", "oracle AUC", "joint calibration",
                                         "DLRM calibration"], rows), "",
                f"Retrieval NDCG@10 of the joint model {num(get(by, 'joint.test.ndcg@10'))}, of the "
                f"retrieval-only model {num(get(by, 'retrieval-only.test.ndcg@10'))} "
                f"({get(by, 'retrieval-only.date') or MISSING}{_former_rule(ds, by)}). Joint: {first.get('epochs')} epochs, "
                f"{num(first.get('train_seconds', 0) / 60, '.0f')} min. "
                f"Machine: {machine_text(first.get('machine'))}. Date: {first.get('date', MISSING)}.", ""]
    budget = next((r.get("budget_min") for r in sorted(recs, key=lambda r: r.get("date", ""), reverse=True)
                   if r.get("variant") == "joint" and r.get("budget_min")), None)
    if not any(r.get("dataset") == "kuairand" for r in recs):
        out += ["Second public anchor: KuaiRand-Pure (real click / like labels, CC BY-SA 4.0): converter and "
                "config ship (`genrec data convert kuairand`, `configs/ranking_kuairand.toml`), but the data "
                "cannot be downloaded on this machine, so no figure is measured (docs/training.md says how to "
                "obtain it).", ""]
    out.append(f"Command: `python -m genrec.benchmarks.ranking --datasets synthetic,ml1m"
               f"{'' if budget is None else f' --budget-min {budget:g}'}`.")
    return out


def distributed(d: dict) -> list[str]:
    rows = [[name, num(r.get("samples_per_s"), ".0f"), num(r.get("vs_one_process"), ".2f", "x"),
             num(get(r, "comm_bytes_per_rank_step.total") / 1e6 if get(r, "comm_bytes_per_rank_step.total")
                 is not None else None, ".2f")]
            for name, r in d.get("runs", {}).items()]
    cmd = command(d, f"python -m genrec.benchmarks.distributed --steps {d.get('steps', 60)} "
                     f"--users {d.get('users', 30000)}")
    return ["## Distributed training (synthetic ads, TorchRec sharding over gloo)", "",
            "Anchor: one process. Ranks share the same cores over loopback TCP, so this checks that "
            "sharded training works and measures its traffic, not scaling.", "",
            *table(["run", "samples/s", "x 1 process", "comm MB per rank per step"], rows), *footer(d, cmd)]


def quant(d: dict) -> list[str]:
    rows = []
    for r in d.get("rows", []):
        goal = QUANT_GOALS.get(r.get("embeddings"))
        ok = "-"
        if goal and r.get("table_ratio") is not None and r.get("ndcg_rel_loss") is not None:
            ok = "yes" if r["table_ratio"] <= goal[0] and r["ndcg_rel_loss"] <= goal[1] else "no"
        rows.append([str(r.get("embeddings", MISSING)), str(r.get("dense", MISSING)),
                     num(r.get("table_ratio"), ".3f", "x"), num(r.get("artifact_ratio"), ".3f", "x"),
                     num(r.get("test_ndcg@10")), num(r.get("ndcg_rel_loss") * 100 if r.get("ndcg_rel_loss")
                                                     is not None else None, "+.2f", "%"), ok])
    qat = [[str(q.get("qat")), str(q.get("embeddings")), num(q.get("quantized_test_ndcg@10")),
            num(q.get("relative_loss") * 100 if q.get("relative_loss") is not None else None, "+.2f", "%")]
           for q in d.get("qat", [])]
    goals = "; ".join(f"{k} tables <= {t:.2f}x fp32 with <= {loss:.0%} NDCG@10 loss"
                      for k, (t, loss) in QUANT_GOALS.items())
    budget = next((q.get("budget_min") for q in d.get("qat", []) if q.get("budget_min")), None)
    cmd = command(d, f"python -m genrec.benchmarks.quant --run {d.get('run', 'RUN_DIR')}"
                     f"{'' if budget is None else f' --qat-budget-min {budget:g}'}")
    out = ["## Quantization (ML-1M HSTU serving artifacts, test split)", "", f"Anchor: goals {goals}.", "",
           *table(["tables", "dense", "table bytes", "artifact bytes", "NDCG@10", "NDCG@10 loss",
                   "meets goal"], rows)]
    if qat:
        out += ["", *table(["QAT", "served tables", "served NDCG@10", "loss from quantization"], qat)]
    return out + footer(d, cmd)


def serving(d: dict) -> list[str]:
    slo = d.get("slo_p99_ms")
    budgets = sorted({b for r in d.get("engines", {}).values() for b in (r.get("max_qps_by_budget") or {})},
                     key=float)
    rows = [[name, num(r.get("max_qps_within_slo"), "g"), num(get(r, "single_request.p50_ms"), ".2f"),
             num(get(r, "single_request.p99_ms"), ".2f"),
             *(num(get(r, f"max_qps_by_budget.{b}"), "g") for b in budgets if float(b) != slo)]
            for name, r in d.get("engines", {}).items()]
    cmd = command(d, f"python -m genrec.benchmarks.serving --artifact {d.get('artifact', 'DIR')}")
    return ["## Serving (ML-1M HSTU int8 artifact, open-loop load test)", "",
            f"Anchor: goal {SERVING_GOAL_QPS} QPS with p99 <= {num(slo, 'g')} ms, at least 2x the naive "
            f"(one request at a time) server. Requests: history {num(get(d, 'workload.history'), 'd')}, "
            f"retrieve {num(get(d, 'workload.retrieve_k'), 'd')}, rank {num(get(d, 'workload.rank'), 'd')}, "
            f"return {num(get(d, 'workload.top_k'), 'd')}. Max QPS: the highest offered step up to which "
            "every step met the budget (torch: the median of its sweeps).", "",
            *table(["server", f"max QPS, p99 <= {num(slo, 'g')} ms", "single request p50 ms", "p99 ms",
                    *(f"max QPS, p99 <= {b} ms" for b in budgets if float(b) != slo)], rows),
            "", "Latency against load: [results/serving_latency.png](results/serving_latency.png).",
            *footer(d, cmd)]


def engine_capacity(d: dict) -> list[str]:
    sizes = sorted((d.get("batch_ms") or {}), key=int)
    paths = [("native (default)", "batch_ms"), ("padded PyTorch", "padded_batch_ms"), ("jagged model", "jagged_batch_ms")]
    rows = [[label, *(num(get(d, f"{key}.{b}"), ".2f") for b in sizes)] for label, key in paths]
    cmd = command(d, f"python -m genrec.benchmarks.engine_capacity --artifact {d.get('artifact', 'DIR')}")
    return ["## Engine capacity (the batched engine alone, simulated open loop)", "",
            f"Anchor: goal {num(d.get('goal_qps'), 'g')} QPS with p99 <= {num(d.get('slo_p99_ms'), 'g')} ms. "
            f"Reached: **{num(d.get('max_qps_within_slo'), 'g')} QPS** (an optimistic bound: the front-end, "
            "IPC and the load generator come on top).", "",
            *table(["engine ms for a batch of B", *sizes], rows), *footer(d, cmd)]


def serving_scale(d: dict) -> list[str]:
    rows = [[eng, h, num(v.get("p50_ms"), ".1f"), num(v.get("p99_ms"), ".1f"),
             num(r.get("server_rss_mb"), ".0f"), num(r.get("recall_at_100_vs_exact"), ".3f")]
            for eng, r in d.get("engines", {}).items()
            for h, v in sorted((r.get("latency_by_history") or {}).items(), key=lambda kv: int(kv[0]))]
    cmd = command(d, "python -m genrec.benchmarks.serving_scale")
    ix = d.get("index") or {}
    index = (f" Rows `-ann`: the artifact's ANN index (`{ix.get('factory')}`, nprobe {ix.get('nprobe')}, shortlist "
             f"{ix.get('shortlist')} re-scored exactly), recall@100 of its Retrieve against the exact server's."
             if ix else "")
    planted = (" Planted: an untrained model whose item table holds topic-clustered rows (no logs, no training)."
               if d.get("planted") else "")
    # scale_serve's open-loop steps per search (its ANN servers): p99 with failures counted, and the max QPS
    loads = {name: r["loadtest"] for name, r in (d.get("searches") or {}).items() if r.get("loadtest")}
    load_rows = [[name, num(s.get("offered_qps"), "g"), num(s.get("p50_ms"), ".1f"), num(s.get("p99_all_ms"), ".1f"),
                  num(s.get("compute_p99_ms"), ".1f"), num(s.get("mean_batch"), ".2f")]
                 for name, lt in loads.items() for s in lt.get("steps", [])]
    load = (["", "Open-loop load (Poisson, server on one CPU, generator on the other; p99 counts failures as "
             "infinitely slow): max QPS within the p99 budget "
             + ", ".join(f"{name} {num(lt.get('max_qps_within_slo'), 'g')}" for name, lt in loads.items()) + ".", "",
             *table(["search", "offered QPS", "p50 ms", "p99 ms", "engine batch p99 ms", "mean batch"], load_rows)]
            if loads else [])
    return [f"## Serving at scale ({num(d.get('catalogue_size'), ',d')}-item catalogue, long histories)", "",
            "Anchor: none set; a scale check (one request at a time, exact top-k over the whole catalogue, "
            f"artifact {num((d.get('artifact_bytes') or 0) / 1e6 if d.get('artifact_bytes') else None, '.0f')} MB)."
            + index + planted, "",
            *table(["engine", "history", "p50 ms", "p99 ms", "server RSS MB", "recall@100"], rows), *load,
            *footer(d, cmd)]


def resilience(d: dict) -> list[str]:
    cap = d.get("capacity_qps")
    rows = [[name, num(s.get("capacity_qps", cap), ".0f"), f"{num(r.get('offered_qps'), 'g')} ({num(r.get('multiple'), 'g')}x)",
             num(r.get("goodput") / own if r.get("goodput") is not None and (own := s.get("capacity_qps", cap))
                 else None, ".2f", "x"),
             num(r.get("goodput_within_2x_x"), ".2f", "x"),
             num(r.get("refused_p50_ms"), ".1f"), num(r.get("p99_ms"), ".1f"), num(r.get("send_late_p99_ms"), ".0f")]
            for name, s in d.get("servers", {}).items() for r in s.get("overload", [])]
    kill, stop = d.get("engine_kill") or {}, d.get("shutdown") or {}
    two = [f"{name}: quiet caller p99 {num(t.get('quiet_alone_p99_ms'), '.1f')} ms alone, "
           f"{num(t.get('quiet_beside_flood_p99_ms'), '.1f')} ms beside a 4x flood ({num(t.get('ratio'), '.2f')}x)"
           for name, s in d.get("servers", {}).items() if (t := s.get("two_callers"))]
    rec = [f"{name}: p99 back within {num(r['recovery'].get('bound_ms'), '.1f')} ms "
           f"{num(r['recovery'].get('recovered_after_s'), '.2f')} s after the 8x spike"
           for name, s in d.get("servers", {}).items() for r in s.get("overload", []) if r.get("recovery")]
    pin = d.get("pinning")
    cmd = command(d, f"python -m genrec.benchmarks.resilience --artifact {d.get('artifact', 'DIR')}")
    return ["## Resilience (overload, engine crash, shutdown)", "", f"Anchor: targets: {RESILIENCE_TARGETS}. "
            f"Capacity: each server's own sweep (the default server's {num(cap, '.0f')} answers/s sets the crash "
            "and shutdown runs' load)"
            + (f"; server on CPU {pin['server_cpus']}, load generator on {pin['generator_cpus']}" if pin else "")
            + f"; sender: {d.get('sender', 'python')}.", "",
            *table(["server", "capacity QPS", "offered QPS", "goodput x capacity", "within 2x budget", "refused p50 ms",
                    "admitted p99 ms", "sender late p99 ms"], rows), "",
            f"A step whose sender ran more than {GENERATOR_LATE_MS:g} ms late (p99) measured the load "
            "generator as much as the server.", "",
            f"Engine SIGKILL at {num(kill.get('offered_qps'), '.0f')} QPS: {num(kill.get('failed_pct'), '.2f')}% "
            + (f"of calls failed, the last {num(kill.get('last_failure_after_kill_s'), '.1f')} s after the kill. "
               if kill.get("failed") != 0 else f"of calls failed (none of {num(kill.get('sent'), ',d')}). ")
            + f"SIGTERM: exit code {num(stop.get('exit_code'), 'd')} after {num(stop.get('exit_s'), '.1f')} s "
            f"(grace {num(stop.get('grace_s'), 'g')} s), engine processes left {num(stop.get('engine_processes_left'), 'd')}."
            + "".join(f" {x}." for x in two + rec), *footer(d, cmd)]


def generic(name: str, d: Any) -> list[str]:
    d = d if isinstance(d, dict) else {}
    rows = [[k, num(v, "g")] for k, v in sorted(d.items())
            if isinstance(v, int | float) and not isinstance(v, bool)]
    return [f"## {name}", "", "Anchor: none recorded.", "", *table(["figure", "value"], rows),
            *footer(d, command(d, f"python -m genrec.benchmarks.{name.split('_')[0]}"))]

