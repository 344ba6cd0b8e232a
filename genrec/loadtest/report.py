"""A load test's results for a person: a markdown table, a latency-vs-load plot, and the
files ``genrec loadtest`` writes (``loadtest.json``, ``loadtest.md``, ``latency_vs_load.png``).

In: a :class:`~genrec.loadtest.results.LoadTestResult`; out: text and files. The plot needs
matplotlib (the ``plot`` extra) and is skipped without it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from genrec.loadtest.results import LoadTestResult, StepResult


def markdown(result: LoadTestResult) -> str:
    """The sweep as markdown: the headline figure, a row of latencies per step, the cache per
    step (when the server reported one), and what the columns mean."""
    head = (f"Target {result.target}, {result.method} ({result.sender} sender), p99 budget {result.slo_p99_ms:g} ms: "
            f"**max QPS within budget: {result.max_qps_within_slo:g}** (every step up to it met the budget)"
            + (f"; the highest step that met it: {result.highest_passing_qps:g} QPS"
               if result.highest_passing_qps != result.max_qps_within_slo else ""))
    lines = [head, "", *_latency_table(result.steps)]
    if any(s.hit_rate is not None or s.cache_bytes is not None for s in result.steps):
        lines += ["", *_cache_table(result.steps)]
    return "\n".join([*lines, "", COLUMNS])


COLUMNS = ("In server: the response's own timing (decode, queue, batch); engine batch: the batch the call rode "
           "in, as the engine timed it; outside: the rest of each call's latency (the generator's lateness, both "
           "gRPC stacks, the transport, process wake-ups). Parts of the server's share: decode (parse, validate), "
           "wait for the engine (until the engine began the call's batch: queued behind the batches before it, "
           "and the batch's trip to the engine), hand-off (the results' trip back from the end of the engine's "
           "compute). Machine busy / steal: the share of all CPUs' time busy during the "
           "step (the generator's own included when it shares the machine), and the share the hypervisor ran "
           "something else while a virtual CPU had work (Linux /proc/stat).")


def _latency_table(steps: list[StepResult]) -> list[str]:
    lines = ["| offered QPS | achieved ok/s | sent | p50 ms | p90 ms | p99 ms | p99.9 ms | p99 incl. errors | errors "
             "| in server p50 / p99 ms | engine batch p50 / p99 ms | outside p50 / p99 ms | send late p99 ms "
             "| mean batch | decode p50 / p99 ms | wait for the engine p50 / p99 ms | hand-off p50 / p99 ms "
             "| machine busy / steal % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        err = ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "-"
        lines.append(f"| {s.offered_qps:g} | {s.achieved_qps:.1f} | {s.sent} | {s.p50_ms:.2f} | {s.p90_ms:.2f} | "
                     f"{s.p99_ms:.2f} | {s.p999_ms:.2f} | {s.p99_all_ms:.2f} | {err} | {s.server_p50_ms:.2f} / "
                     f"{s.server_p99_ms:.2f} | {s.compute_p50_ms:.2f} / {s.compute_p99_ms:.2f} | {s.outside_p50_ms:.2f} / {s.outside_p99_ms:.2f} | "
                     f"{s.send_late_p99_ms:.2f} | {s.mean_batch:.1f} | {s.decode_p50_ms:.2f} / {s.decode_p99_ms:.2f} | "
                     f"{s.wait_p50_ms:.2f} / {s.wait_p99_ms:.2f} | {s.handoff_p50_ms:.2f} / {s.handoff_p99_ms:.2f} | "
                     f"{s.cpu_busy_pct:.0f} / {s.steal_pct:.1f} |")
    return lines


def _cache_table(steps: list[StepResult]) -> list[str]:
    return ["| offered QPS | cache hit rate | cache hits / misses | evicted tokens | cache MB | cached users "
            "| used / capacity tokens |", "|---|---|---|---|---|---|---|",
            *(f"| {s.offered_qps:g} | {_fig(s.hit_rate, '.3f')} | {_fig(s.cache_hits, '.0f')} / "
              f"{_fig(s.cache_misses, '.0f')} | {_fig(s.cache_evicted_tokens, '.0f')} | "
              f"{_fig(s.cache_bytes / 2**20 if s.cache_bytes is not None else None, '.1f')} | "
              f"{_fig(s.cache_users, '.0f')} | {_fig(s.cache_used_tokens, '.0f')} / "
              f"{_fig(s.cache_capacity_tokens, '.0f')} |" for s in steps)]


def _fig(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def plot(results: dict[str, LoadTestResult], out: Path, slo_ms: float) -> Path | None:
    """p50 / p99 against offered QPS, as one PNG; None without matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        qps = [s.offered_qps for s in r.steps]
        p99 = [min(s.p99_all_ms, 1e4) for s in r.steps]
        line = ax.plot(qps, p99, marker="o", label=f"{name} p99")[0]
        ax.plot(qps, [s.p50_ms for s in r.steps], ls="--", color=line.get_color(), alpha=0.6, label=f"{name} p50")
    ax.axhline(slo_ms, color="red", lw=1, label=f"p99 budget {slo_ms:g} ms")
    ax.set(xlabel="offered load (QPS)", ylabel="latency (ms, failures as infinite)", yscale="log",
           title="latency vs offered load (open loop)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_outputs(result: LoadTestResult, out_dir: str | Path) -> Path:
    """``out_dir``/loadtest.json (every figure), loadtest.md (:func:`markdown`) and
    latency_vs_load.png (:func:`plot`, when matplotlib is there); returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    (out / "loadtest.md").write_text(markdown(result) + "\n")
    plot({"server": result}, out / "latency_vs_load.png", result.slo_p99_ms)
    return out

