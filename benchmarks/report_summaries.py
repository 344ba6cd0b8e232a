"""One line per benchmark for the at-a-glance table at the top of RESULTS.md: each a pure
function of one results JSON to (headline, anchor)."""

from __future__ import annotations

from typing import Any

from genrec.benchmarks.report_format import MISSING, get, num
from genrec.benchmarks.report_sections import (
    GENERATOR_LATE_MS,
    PUBLISHED,
    QUANT_GOALS,
    SERVING_GOAL_QPS,
)

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
    return (f"HSTU attention: {best or MISSING} {num(ratios.get(best) if best else None, '.2f', 'x')} "
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
    servers = d.get("servers", {})
    shown = []  # the default server's, and the native front end's where it ran
    for name in ("default", "admission (default)", "native front-end"):  # ("admission": the name before issue 46)
        at4 = next((r for r in servers.get(name, {}).get("overload", []) if r.get("multiple") == 4), None)
        if at4 is None:
            continue
        good, late = at4.get("goodput"), at4.get("send_late_p99_ms")
        own = servers[name].get("capacity_qps", cap)  # (each server's own since 2026-12-07)
        bound = f" (sender {late:.0f} ms late: generator-bound)" if late is not None and late > GENERATOR_LATE_MS else ""
        shown.append(f"{name.split(' (')[0]} {num(good / own if good is not None and own else None, '.2f', 'x')}{bound}")
    return (f"goodput at 4x offered (x capacity): {', '.join(shown) or 'n/a'}; "
            f"engine SIGKILL {num(get(d, 'engine_kill.failed_pct'), '.2f', '%')} failed",
            ">= 0.9x; <= 1%")

