"""Renders ``benchmarks/RESULTS.md`` from ``benchmarks/results/*.json``: one page, the
current figures of every benchmark beside their anchors (published numbers or targets),
each section naming its machine, date and the command that produced it.

    python -m genrec.benchmarks.report            # rewrite RESULTS.md
    python -m genrec.benchmarks.report --check    # exit 1 if RESULTS.md differs from the JSON

The page is a pure function of the JSON files (sorted keys, fixed formats, no clock), so
``tests/test_report.py`` can check that the committed page is current. A figure a JSON
lacks renders as ``missing``; a JSON with no renderer of its own gets a generic section.
How the figures came to be goes into ``benchmarks/notes/``, not here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
MISSING = "missing"

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
RESILIENCE_TARGETS = ("goodput >= 0.9x capacity at 4x offered, refusals within 5 ms, admitted p99 "
                      "within 2x the budget; engine SIGKILL at 50% load: <= 1% of calls failed, none "
                      "after 1 s; SIGTERM: exit within the grace period, no call left hanging")


# -- formatting ------------------------------------------------------------------------------

def get(d: Any, path: str) -> Any:
    """``d["a"]["b"]`` for path "a.b"; None where any step is absent."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def num(x: Any, fmt: str = ".4f", suffix: str = "") -> str:
    """A figure, or ``missing``; inf and nan spelled out."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return MISSING if x is None else str(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:{fmt}}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def machine_text(m: Any) -> str:
    if not isinstance(m, dict):
        return MISSING
    parts = [str(m.get("cpu", MISSING)), f"{num(m.get('cores'), 'd')} cores"]
    if m.get("cores_usable") is not None and m.get("cores_usable") != m.get("cores"):
        parts[-1] += f" ({num(m['cores_usable'], 'd')} usable)"
    parts.append(f"torch threads {num(m.get('threads'), 'd')}")
    parts.append(f"GPU {m['gpu']}" if m.get("gpu") else "no GPU")
    parts.append(f"torch {m.get('torch', MISSING)}")
    return ", ".join(parts)


def command(d: dict, default: str) -> str:
    """The recorded command (renamed to the installed package's module path), else the default."""
    cmd = d.get("command") if isinstance(d, dict) else None
    if not cmd:
        return default
    return cmd.replace("python -m benchmarks.", "python -m genrec.benchmarks.")


def footer(d: dict, cmd: str) -> list[str]:
    return ["", f"Machine: {machine_text(d.get('machine'))}. Date: {d.get('date', MISSING)}. "
            f"Command: `{cmd}`."]


# -- sections --------------------------------------------------------------------------------

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
    rows = [[path, num(ms, ".2f"), num(get(d, f"attention.speedup_vs_reference.{path}"), ".2f", "x")]
            for path, ms in sorted(get(d, "attention.ms").items())] if get(d, "attention.ms") else []
    steps = [[name, num(v.get("s_per_step"), ".3f"), num(v.get("sequences_per_s"), ".0f")]
             for name, v in sorted((get(d, "train_step") or {}).items()) if isinstance(v, dict)]
    dev = d.get("device", "cpu")
    cmd = command(d, "python -m genrec.benchmarks.kernels" + ("" if dev == "cpu" else f" --device {dev}"))
    return [f"## Kernels ({dev}): HSTU attention forward + backward, ML-1M-shaped batch", "",
            "Anchor: the pure-PyTorch reference (1.00x).", "",
            *table(["path", "ms", "vs reference"], rows), "",
            *table(["training step", "s/step", "sequences/s"], steps), *footer(d, cmd)]


def _calibration(by: dict, variant: str, task: str) -> str:
    """NE and ECE of a ranking record's test split, calibrated (uncalibrated), and the ECE floor."""
    def f(k: str, fmt: str = ".4f") -> str:
        return num(get(by, f"{variant}.test.{task}/{k}"), fmt)

    if get(by, f"{variant}.test.{task}/ece_floor") is None:  # a record from before calibration
        return f"NE {f('ne', '.3f')}"
    return (f"NE {f('ne', '.3f')} ({f('ne_uncalibrated', '.3f')}), ECE {f('ece')} ({f('ece_uncalibrated')}), "
            f"floor {f('ece_floor')}")


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
                f"({get(by, 'retrieval-only.date') or MISSING}). Joint: {first.get('epochs')} epochs, "
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
             num(r.get("server_rss_mb"), ".0f")]
            for eng, r in d.get("engines", {}).items()
            for h, v in sorted((r.get("latency_by_history") or {}).items(), key=lambda kv: int(kv[0]))]
    cmd = command(d, "python -m genrec.benchmarks.serving_scale")
    return [f"## Serving at scale ({num(d.get('catalogue_size'), ',d')}-item catalogue, long histories)", "",
            "Anchor: none set; a scale check (one request at a time, exact top-k over the whole catalogue, "
            f"artifact {num((d.get('artifact_bytes') or 0) / 1e6 if d.get('artifact_bytes') else None, '.0f')} MB).", "",
            *table(["engine", "history", "p50 ms", "p99 ms", "server RSS MB"], rows), *footer(d, cmd)]


def resilience(d: dict) -> list[str]:
    cap = d.get("capacity_qps")
    rows = [[name, f"{num(r.get('offered_qps'), 'g')} ({num(r.get('multiple'), 'g')}x)",
             num(r.get("goodput") / cap if r.get("goodput") is not None and cap else None, ".2f", "x"),
             num(r.get("refused_p50_ms"), ".1f"), num(r.get("p99_ms"), ".1f")]
            for name, s in d.get("servers", {}).items() for r in s.get("overload", [])]
    kill, stop = d.get("engine_kill") or {}, d.get("shutdown") or {}
    cmd = command(d, f"python -m genrec.benchmarks.resilience --artifact {d.get('artifact', 'DIR')}")
    return ["## Resilience (overload, engine crash, shutdown)", "", f"Anchor: targets: {RESILIENCE_TARGETS}. "
            f"Capacity: {num(cap, '.0f')} answers/s (the default server's sweep).", "",
            *table(["server", "offered QPS", "goodput x capacity", "refused p50 ms", "admitted p99 ms"], rows), "",
            f"Engine SIGKILL at {num(kill.get('offered_qps'), '.0f')} QPS: {num(kill.get('failed_pct'), '.2f')}% "
            f"of calls failed, the last {num(kill.get('last_failure_after_kill_s'), '.1f')} s after the kill. "
            f"SIGTERM: exit code {num(stop.get('exit_code'), 'd')} after {num(stop.get('exit_s'), '.1f')} s "
            f"(grace {num(stop.get('grace_s'), 'g')} s), engine processes left {num(stop.get('engine_processes_left'), 'd')}.",
            *footer(d, cmd)]


def generic(name: str, d: Any) -> list[str]:
    d = d if isinstance(d, dict) else {}
    rows = [[k, num(v, "g")] for k, v in sorted(d.items())
            if isinstance(v, int | float) and not isinstance(v, bool)]
    return [f"## {name}", "", "Anchor: none recorded.", "", *table(["figure", "value"], rows),
            *footer(d, command(d, f"python -m genrec.benchmarks.{name.split('_')[0]}"))]


# -- one line per benchmark for the table at the top: (headline, anchor) -----------------------

PRIMARY = {"ml1m": "HSTU (paper)", "beauty": "TIGER (paper)"}


def _newest(records: list[dict], **match: Any) -> dict:
    rows = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    return max(rows, key=lambda r: str(r.get("date", "")), default={})


def quality_summary(d: dict) -> tuple[str, str]:
    recs = d.get("records", [])
    heads, anchors = [], []
    for ds in sorted({r.get("dataset") for r in recs}, key=lambda s: (s != "ml1m", str(s))):
        r = _newest(recs, dataset=ds, model="hstu")
        heads.append(f"{ds} HSTU HR@10 {num(r.get('hr@10'))} / NDCG@10 {num(r.get('ndcg@10'))}")
        pub = next((p for p in PUBLISHED.get(ds, []) if p[0] == PRIMARY.get(ds)), None)
        anchors.append(f"{pub[0]} {pub[1]:.4f} / {pub[2]:.4f}" if pub else f"{ds}: none")
    return "; ".join(heads), "; ".join(anchors)


def train_speed_summary(d: dict) -> tuple[str, str]:
    return (f"shipped step {num(d.get('speedup'), '.2f', 'x')} the naive one",
            f"goal {num(d.get('goal'), '.1f', 'x')}")


def kernels_summary(d: dict) -> tuple[str, str]:
    ratios = get(d, "attention.speedup_vs_reference") or {}
    best = max(ratios, key=lambda k: ratios[k], default=None)
    return (f"HSTU attention, {best or MISSING} path: {num(ratios.get(best) if best else None, '.2f', 'x')} "
            "the reference", "pure-PyTorch reference 1.00x")


def ranking_summary(d: dict) -> tuple[str, str]:
    recs, heads, anchors = d.get("records", []), [], []
    for ds in sorted({r.get("dataset") for r in recs}, key=str):
        joint, dlrm = _newest(recs, dataset=ds, variant="joint"), _newest(recs, dataset=ds, variant="dlrm")
        task = min((k.split("/")[0] for k in joint.get("test", {}) if k.endswith("/auc")), default=None)
        heads.append(f"{ds} {task or MISSING} AUC {num(get(joint, f'test.{task}/auc') if task else None)}")
        anchors.append(f"DLRM {num(get(dlrm, f'test.{task}/auc') if task else None)}")
    return "; ".join(heads), "; ".join(anchors)


def distributed_summary(d: dict) -> tuple[str, str]:
    ratios = [r.get("vs_one_process") for r in d.get("runs", {}).values() if r.get("world_size", 1) > 1]
    ratios = [x for x in ratios if isinstance(x, int | float)]
    span = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else MISSING
    return f"2 processes on the same cores: {span} of one process's samples/s", "one process (1.00x)"


def quant_summary(d: dict) -> tuple[str, str]:
    parts = []
    for scheme in QUANT_GOALS:
        r = next((r for r in d.get("rows", []) if r.get("embeddings") == scheme and r.get("dense") == "fp32"), {})
        loss = r.get("ndcg_rel_loss")
        parts.append(f"{scheme} tables {num(r.get('table_ratio'), '.3f', 'x')}, NDCG@10 loss "
                     f"{num(loss * 100 if loss is not None else None, '+.2f', '%')}")
    goals = "; ".join(f"{k} <= {t:.2f}x, <= {loss:.0%}" for k, (t, loss) in QUANT_GOALS.items())
    return "; ".join(parts), goals


def serving_summary(d: dict) -> tuple[str, str]:
    slo = num(d.get("slo_p99_ms"), "g")
    return (f"torch {num(get(d, 'engines.torch.max_qps_within_slo'), 'g')} QPS within p99 {slo} ms "
            f"(naive {num(get(d, 'engines.naive.max_qps_within_slo'), 'g')})",
            f"{SERVING_GOAL_QPS} QPS within p99 {slo} ms, >= 2x naive")


def engine_capacity_summary(d: dict) -> tuple[str, str]:
    return (f"engine alone {num(d.get('max_qps_within_slo'), 'g')} QPS within p99 {num(d.get('slo_p99_ms'), 'g')} ms",
            f"{num(d.get('goal_qps'), 'g')} QPS")


def serving_scale_summary(d: dict) -> tuple[str, str]:
    lat = get(d, "engines.torch.latency_by_history") or {}
    h = min(lat, key=int, default=None)
    return (f"torch p99 {num(get(lat, f'{h}.p99_ms') if h else None, '.1f')} ms at {h or MISSING} events, "
            f"{num(d.get('catalogue_size'), ',d')} items", "none set")


def resilience_summary(d: dict) -> tuple[str, str]:
    cap = d.get("capacity_qps")
    at4 = next((r for r in get(d, "servers.admission (default).overload") or [] if r.get("multiple") == 4), {})
    good = at4.get("goodput")
    return (f"goodput at 4x offered {num(good / cap if good is not None and cap else None, '.2f', 'x')} capacity; "
            f"engine SIGKILL {num(get(d, 'engine_kill.failed_pct'), '.2f', '%')} failed",
            ">= 0.9x; <= 1%")


def _lazy(module: str, name: str) -> Callable[[dict], Any]:
    """A renderer that lives beside its benchmark (imported on use: it imports this module)."""

    def call(d: dict) -> Any:
        import importlib

        return getattr(importlib.import_module(f"genrec.benchmarks.{module}"), name)(d)

    return call


SUMMARIES: dict[str, Callable[[dict], tuple[str, str]]] = {
    "quality": quality_summary, "train_speed": train_speed_summary, "kernels": kernels_summary,
    "ranking": ranking_summary, "distributed": distributed_summary, "quant": quant_summary,
    "serving": serving_summary, "engine_capacity": engine_capacity_summary,
    "serving_scale": serving_scale_summary, "resilience": resilience_summary,
    "serving_cache": _lazy("serving_cache", "serving_cache_summary"),
    "long_history": _lazy("long_history", "long_history_summary"),
    "sid_decoding": _lazy("sid_decoding", "sid_decoding_summary"),
    "sid_quality": _lazy("sid_quality", "sid_quality_summary"),
    "ranking_serving": _lazy("ranking_serving", "ranking_serving_summary"),
    "ranking_bounds": _lazy("ranking_bounds", "ranking_bounds_summary"),
    "train_ops": _lazy("train_ops", "train_ops_summary"),
    "ranking_curve": _lazy("ranking_curve", "ranking_curve_summary"),
    "data_reader": _lazy("data_reader", "data_reader_summary"),
    "gate": _lazy("gate_evidence", "gate_summary"),
}


SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "quality": quality, "train_speed": train_speed, "kernels": kernels, "ranking": ranking,
    "distributed": distributed, "quant": quant, "serving": serving, "engine_capacity": engine_capacity,
    "serving_scale": serving_scale, "resilience": resilience,
    "serving_cache": _lazy("serving_cache", "serving_cache"), "long_history": _lazy("long_history", "long_history"),
    "sid_decoding": _lazy("sid_decoding", "sid_decoding"),
    "sid_quality": _lazy("sid_quality", "sid_quality"),
    "ranking_serving": _lazy("ranking_serving", "ranking_serving"),
    "ranking_bounds": _lazy("ranking_bounds", "ranking_bounds"), "ranking_curve": _lazy("ranking_curve", "ranking_curve"),
    "train_ops": _lazy("train_ops", "train_ops"),
    "data_reader": _lazy("data_reader", "data_reader"),
    "gate": _lazy("gate_evidence", "gate"),
}


def renderer(stem: str) -> Callable[[dict], list[str]] | None:
    """kernels_cuda.json renders like kernels.json."""
    return SECTIONS.get(stem) or (kernels if stem.startswith("kernels_") else None)


def render(results: Path = RESULTS) -> str:
    """The whole page for every ``*.json`` under ``results``, in a fixed order."""
    order = list(SECTIONS)
    files = sorted(results.glob("*.json"), key=lambda p: (order.index(p.stem) if p.stem in order
                                                          else len(order), p.stem))
    out = ["# Benchmark results", "",
           "Generated by `python -m genrec.benchmarks.report` from `benchmarks/results/*.json`; do not "
           "edit by hand (each benchmark rewrites its JSON and this page). Every section gives its "
           "headline figures beside their anchor, the machine, the date and the command. Compare "
           "speeds only between runs on the same CPU: the development VM's CPU changed between runs "
           "under the same name. How the figures came to be: `benchmarks/notes/`."]
    glance, sections = [], []
    for path in files:
        data = json.loads(path.read_text())
        fn = renderer(path.stem)
        summary = SUMMARIES.get(path.stem) or (kernels_summary if fn is kernels else None)
        try:
            body = fn(data) if fn else generic(path.stem, data)
            head, anchor = summary(data) if summary else ("see below", "none recorded")
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a malformed file keeps the page
            body = [f"## {path.stem}", "", f"`{path.name}` could not be rendered ({type(e).__name__}: {e}); "
                    "figures missing."]
            head, anchor = MISSING, MISSING
        date = data.get("date") if isinstance(data, dict) else None
        if date is None and isinstance(data, dict) and data.get("records"):
            date = max(str(r.get("date", "")) for r in data["records"] if isinstance(r, dict))
        glance.append([f"[{path.stem}](#{anchor_id(body[0])})", head, anchor, str(date or MISSING)])
        sections += ["", f"<!-- {path.stem}: results/{path.name} -->", *body]
    out += ["", "## At a glance", "", *table(["benchmark", "headline", "anchor", "date"], glance)]
    return "\n".join(out + sections) + "\n"


def anchor_id(heading: str) -> str:
    """GitHub's id of a Markdown heading: lower case, punctuation dropped, spaces as '-'."""
    text = heading.lstrip("#").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def write(results: Path = RESULTS, out: Path = RESULTS_MD) -> bool:
    """Rewrites ``out``; True when it changed."""
    text = render(results)
    if out.exists() and out.read_text() == text:
        return False
    out.write_text(text)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is not the rendered page")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of *.json (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_MD, help="page to write (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.check:
        stale = not args.out.exists() or args.out.read_text() != render(args.results)
        print(f"{args.out} is {'stale: run python -m genrec.benchmarks.report' if stale else 'current'}")
        return int(stale)
    print(f"{args.out} {'rewritten' if write(args.results, args.out) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
