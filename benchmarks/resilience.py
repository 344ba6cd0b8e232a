"""Resilience benchmark: the serving tier under overload, between callers, an engine crash
and a shutdown, measured the way a client sees it.

One run, one artifact, ``genrec serve`` processes on 127.0.0.1. Where the machine has two or
more CPUs the whole server (front-end and engine processes) is pinned to the last CPU and
this load generator to the others, so that the generator does not take the server's CPU
(recorded as ``pinning``). Open-loop Poisson load, sent by the C++ sender where it builds
(``--sender``, recorded as ``sender``: genrec.loadtest.sender); an answer after its deadline is
a failure:

* capacity: the most calls per second each server answers, from a sweep of offered
  loads that goes on past saturation (less than 90% of what is offered answered) until two
  steps in a row answer no more than the best so far (beside it, the highest step within the
  p99 budget, ``--slo-p99-ms``); measured for each server, since what a server answers at most
  is what its overload is a multiple of (the native front end answers more than the default);
* overload: 2x, 4x and 8x its capacity offered for ``--overload-s`` each, to the default
  server and, one after another, the thread-pool listener (``front_end = "threads"``), the C++ front
  end (``front_end = "native"``: serve.proxy) and the former
  defaults (64 handler slots, gRPC's own pending bound of 1000, no per-caller shares): goodput (answered calls per second, and those
  within 2x the budget) as a multiple of capacity, how fast refusals came back, the answered
  calls' p99, the server's memory, the generator's own lateness;
* recovery: right after the 8x spike, half of capacity: when the p99 of 250 ms windows is back
  within 1.5x of its value before the spike;
* two callers: one (tenant ``quiet``) at a quarter of capacity alone, then beside another
  (tenant ``flood``) offering 4x capacity: the quiet caller's p99 (failures count as misses);
* engine crash: 50% of capacity, once the standby has loaded the serving engine process is
  SIGKILLed mid-run: failed calls and when the last one failed, relative to the kill;
* shutdown: 50% of capacity, SIGTERM mid-run: how long the server took to exit and what the
  calls sent before the signal got (those sent after it find no server: UNAVAILABLE).

    python -m genrec.benchmarks.resilience --artifact DIR [--slo-p99-ms 15]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import grpc
import numpy as np

from genrec.benchmarks.common import (
    ROOT,
    machine,
    pin_process,
    today,
    update_results_md,
    write_json,
)
from genrec.benchmarks.serving import artifact_and_requests
from genrec.loadtest.runner import RESPONSES, native_step, run_step
from genrec.loadtest.sender import choose
from genrec.loadtest.workload import load_workload

STEPS = [50, 100, 150, 200, 300, 400, 500, 600, 800, 1000, 1200, 1600]
BATCHED = ["--serve.batch.max_batch=32", "--serve.batch.max_wait_ms=0", "--serve.process.poll_ms=1000"]
# the listener and caller limits before issue 46 (gRPC's own pending bound: a soft 1000)
FORMER = ["--serve.connections.max_concurrent_rpcs=64", "--serve.connections.max_pending_calls=1000",
          "--serve.fair.enabled=false"]
# the thread-pool listener (serve.frontend): gRPC refuses past the handler slots on its polling thread
THREADS = ["--serve.connections.front_end=threads"]
# the C++ front end (serve.proxy): calls past its cap refused before the server sees them
NATIVE = ["--serve.connections.front_end=native"]
# ... with calls past its cap refused at once, not waiting for a place (before issue 46's recovery work)
NATIVE_NO_WAIT = [*NATIVE, "--serve.connections.max_wait_ms=0"]
SERVERS = {"default": [], "threads front-end": THREADS, "native front-end": NATIVE, "native no-wait": NATIVE_NO_WAIT,
           "former defaults": FORMER}


# who sends (main sets it): the C++ sender (genrec/loadtest/cpp) where it builds; one Python core
# falls behind its schedule past ~2,000 calls/s (benchmarks/notes/2026-12-05-resilience-generator.md)
SENDER = "python"


# the CPUs this run may use, read once before main pins itself to the generator's share of them
CPUS = tuple(sorted(os.sched_getaffinity(0)))


def server_cpus(cpus: tuple[int, ...] = CPUS) -> tuple[list[int], list[int]]:
    """(the server's CPUs, the load generator's) of ``cpus``: the last CPU and the rest, where
    there are two. Not of this process's affinity now: once main has pinned itself to the
    generator's CPUs, that would put every server on them too."""
    return (list(cpus[-1:]), list(cpus[:-1])) if len(cpus) >= 2 else (list(cpus), list(cpus))


class Server:
    """A ``genrec serve`` process: its address, and an event set once its standby engine has loaded."""

    def __init__(self, proc: subprocess.Popen, target: str) -> None:
        self.proc, self.target = proc, target
        self.standby_ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            if "standby engine process" in line and "ready" in line:
                self.standby_ready.set()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def start(artifact: Path, extra: list[str]) -> Server:
    """A server process on the server's CPUs (:func:`server_cpus`), once it listens."""
    cmd = [sys.executable, "-m", "genrec.cli", "serve", "--artifact", str(artifact), "--host", "127.0.0.1",
           "--port", "0", "--threads", "1", *BATCHED, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mine, _ = server_cpus()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, mine))
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode})")
        if m := re.search(r"on 127\.0\.0\.1:(\d+)$", line.strip()):
            return Server(proc, f"127.0.0.1:{m.group(1)}")
    proc.kill()
    raise RuntimeError("server did not start in 300 s")


def children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def rss_mb(pid: int) -> float:
    """Resident memory of the server's front-end process (MB)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return float("nan")
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step(target: str, payloads: list[bytes], qps: float, seconds: float, seed: int, timeout_s: float,
         calls: list | None = None, began: threading.Event | None = None, tenant: str = "") -> dict:
    """One open-loop step, from the native sender where it builds (:data:`SENDER`); ``began``
    is set as it starts sending (its calls' times count from 50 ms later)."""
    metadata = (("tenant", tenant),) if tenant else ()
    if SENDER == "native":
        r = native_step(target, "Recommend", payloads, qps, seconds, timeout_s, seed, 10**7,
                        response=RESPONSES["Recommend"], calls=calls, metadata=metadata, warmup=20, began=began)
        return asdict(r)
    with grpc.insecure_channel(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        call = ch.unary_unary("/genrec.v1.Recommender/Recommend")
        for p in payloads[:20]:  # warm the connection
            try:
                call(p, timeout=5)
            except grpc.RpcError:
                pass
        time.sleep(0.5)
        if began is not None:
            began.set()
        r = run_step(call, payloads, qps, seconds, timeout_s, seed, 10**7, response=RESPONSES["Recommend"],
                     calls=calls, metadata=metadata)
    return asdict(r)


def capacity(target: str, payloads: list[bytes], slo_ms: float, seconds: float) -> tuple[float, float, list[dict]]:
    """(calls answered per second at most, the highest step within the p99 budget, the steps).
    The sweep goes on past the first saturated step until two in a row answer no more than the
    best so far (+3%): a batching server answers more as its batches fill, so the first step it
    cannot keep up with understates what it answers under overload (448/s there, 506/s at 4x, in
    one run of 2026-12-05)."""
    steps, within, ok, flat = [], 0.0, True, 0
    for i, qps in enumerate(STEPS):
        r = step(target, payloads, qps, seconds, i, 1.0)
        best = max((s["achieved_qps"] for s in steps), default=0.0)
        steps.append(r)
        print(f"  capacity step {qps:g}: ok/s {r['achieved_qps']:.0f}, p99(all) {r['p99_all_ms']:.1f} ms", flush=True)
        ok = ok and r["p99_all_ms"] <= slo_ms
        within = qps if ok else within
        if r["ok"] < 0.9 * r["sent"] or r["p99_ms"] > 20 * slo_ms:  # saturated: answers lag or fail
            flat = flat + 1 if r["achieved_qps"] <= 1.03 * best else 0
            if flat == 2:
                break
    return max(r["achieved_qps"] for r in steps), within, steps


def _p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99)) * 1e3 if latencies else float("nan")


def overload(target: str, pid: int, payloads: list[bytes], cap: float, slo_ms: float, seconds: float) -> list[dict]:
    """2x, 4x, 8x capacity; after 8x, half of capacity to see when the p99 is back."""
    out = []
    for mult in (2, 4, 8):
        calls: list = []
        rss0 = rss_mb(pid)
        r = step(target, payloads, round(mult * cap), seconds, 100 + mult, 1.0, calls)
        within = sum(1 for _, took, code in calls if code == "OK" and took * 1e3 <= 2 * slo_ms)
        r.update(multiple=mult, goodput=r["ok"] / r["duration_s"], goodput_within_2x=within / r["duration_s"],
                 goodput_x=r["ok"] / r["duration_s"] / cap, goodput_within_2x_x=within / r["duration_s"] / cap,
                 rss_before_mb=rss0, rss_after_mb=rss_mb(pid))
        print(f"  {mult}x ({round(mult * cap)} QPS): goodput {r['goodput']:.0f}/s = {r['goodput_x']:.2f}x "
              f"({r['goodput_within_2x']:.0f} within {2 * slo_ms:g} ms), answered p99 {r['p99_ms']:.1f} ms, refused "
              f"p50 {r['refused_p50_ms']:.1f} ms, errors {r['errors']}, generator late p99 {r['send_late_p99_ms']:.1f} ms",
              flush=True)
        out.append(r)
        if mult == 8:
            r["recovery"] = recovery(target, payloads, cap, slo_ms)
        else:
            time.sleep(2)
    return out


def recovery(target: str, payloads: list[bytes], cap: float, slo_ms: float, seconds: float = 6.0) -> dict:
    """Half of capacity, sent right after a spike: the p99 of each 250 ms window (failures as
    misses), and the time after which every window is within 1.5x of the p99 of the same load
    measured again after the run settles (the normal p99) and the budget."""
    calls: list = []
    step(target, payloads, cap / 2, seconds, 77, 1.0, calls)
    time.sleep(3)
    settled: list = []
    step(target, payloads, cap / 2, seconds, 78, 1.0, settled)
    normal = _p99([t if c == "OK" else 1.0 for _, t, c in settled])
    windows = []
    for w in np.arange(0, seconds, 0.25):
        lat = [t if c == "OK" else 1.0 for s, t, c in calls if w <= s < w + 0.25]
        windows.append((float(w), _p99(lat)))
    bound = max(1.5 * normal, slo_ms)
    late = [w for w, p in windows if not p <= bound]
    back_s = (late[-1] + 0.25) if late else 0.0
    print(f"  recovery: normal p99 {normal:.1f} ms at half capacity; back within {bound:.1f} ms after {back_s:.2f} s",
          flush=True)
    return {"normal_p99_ms": normal, "bound_ms": bound, "recovered_after_s": back_s, "windows_p99_ms": windows}


def two_callers(target: str, payloads: list[bytes], cap: float, seconds: float) -> dict:
    """The quiet caller alone at a quarter of capacity, then beside a flood of 4x capacity."""
    def quiet_p99(calls: list) -> tuple[float, float]:
        lat = [t if c == "OK" else 1.0 for _, t, c in calls]
        return _p99(lat), 100.0 * sum(c != "OK" for _, _, c in calls) / max(len(calls), 1)

    alone: list = []
    step(target, payloads, cap / 4, seconds, 31, 1.0, alone, tenant="quiet")
    time.sleep(1)
    beside: list = []
    flood: list = []
    t = threading.Thread(target=lambda: step(target, payloads, 4 * cap, seconds + 2, 32, 1.0, flood, tenant="flood"))
    t.start()
    time.sleep(1)
    step(target, payloads, cap / 4, seconds, 33, 1.0, beside, tenant="quiet")
    t.join()
    (p_alone, f_alone), (p_beside, f_beside) = quiet_p99(alone), quiet_p99(beside)
    out = {"quiet_alone_codes": dict(Counter(c for _, _, c in alone)),"quiet_qps": cap / 4, "flood_qps": 4 * cap, "quiet_alone_p99_ms": p_alone, "quiet_alone_failed_pct": f_alone,
           "quiet_beside_flood_p99_ms": p_beside, "quiet_beside_flood_failed_pct": f_beside,
           "ratio": p_beside / p_alone, "quiet_codes": dict(Counter(c for _, _, c in beside)),
           "flood_codes": dict(Counter(c for _, _, c in flood))}
    print(f"  two callers: quiet p99 {p_alone:.1f} ms alone, {p_beside:.1f} ms beside a 4x flood "
          f"({out['ratio']:.2f}x; failed {f_beside:.1f}%: {out['quiet_codes']}); flood {out['flood_codes']}", flush=True)
    return out


def engine_kill(artifact: Path, payloads: list[bytes], cap: float, seconds: float) -> dict:
    """50% of capacity; at a third of the run, SIGKILL of the engine process doing the work."""
    srv = start(artifact, [])
    proc, target = srv.proc, srv.target
    try:
        ready = srv.standby_ready.wait(180)
        calls: list = []
        kill_at = seconds / 3
        result: dict = {}
        began = threading.Event()
        t = threading.Thread(target=lambda: result.update(step(target, payloads, cap / 2, seconds, 7, 1.0, calls,
                                                               began)))
        t.start()
        began.wait(60)
        time.sleep(kill_at)
        kids = children(proc.pid)
        busy = max(kids, key=cpu_seconds)  # the engine serving: a standby has done nothing
        os.kill(busy, signal.SIGKILL)
        t.join()
        failed = [(s, took, code) for s, took, code in calls if code != "OK"]
        last = max((s + took for s, took, _ in failed), default=None)
        out = {"offered_qps": cap / 2, "sent": len(calls), "failed": len(failed),
               "failed_pct": 100.0 * len(failed) / max(len(calls), 1), "codes": dict(Counter(c for _, _, c in calls)),
               "last_failure_after_kill_s": None if last is None else last - kill_at,
               "engine_processes_before": len(kids), "engine_processes_after": len(children(proc.pid)),
               "p99_ms": result.get("p99_ms"), "standby_ready": ready}
        print(f"  engine kill: {out['failed']} of {out['sent']} failed ({out['failed_pct']:.2f}%), last failure "
              f"{out['last_failure_after_kill_s']} s after the kill; codes {out['codes']}", flush=True)
        return out
    finally:
        srv.stop()


def shutdown(artifact: Path, payloads: list[bytes], cap: float, seconds: float) -> dict:
    srv = start(artifact, ["--serve.grace_s=10"])
    proc, target = srv.proc, srv.target
    calls: list = []
    began = threading.Event()
    t = threading.Thread(target=lambda: step(target, payloads, cap / 2, seconds, 9, 2.0, calls, began))
    t.start()
    signal_at = seconds / 3
    began.wait(60)
    time.sleep(signal_at)
    kids = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    t0 = time.perf_counter()
    code = proc.wait(60)
    exit_s = time.perf_counter() - t0
    t.join()
    left = [k for k in kids if Path(f"/proc/{k}").exists()]
    # (calls sent within 50 ms of the signal are left out: sent as it arrived)
    before = Counter(c for s, _, c in calls if s < signal_at - 0.05)
    after = Counter(c for s, _, c in calls if s > signal_at + 0.05)
    out = {"exit_s": exit_s, "exit_code": code, "codes_sent_before": dict(before), "codes_sent_after": dict(after),
           "engine_processes_left": len(left), "grace_s": 10}
    print(f"  SIGTERM: exit {code} after {exit_s:.2f} s; calls sent before {dict(before)}, after {dict(after)}; "
          f"engines left {len(left)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", help="the artifact to serve (default: the serving benchmark's)")
    ap.add_argument("--slo-p99-ms", type=float, default=15.0)
    ap.add_argument("--step-s", type=float, default=6.0, help="seconds per capacity step")
    ap.add_argument("--overload-s", type=float, default=10.0)
    ap.add_argument("--out", default="runs/benchmarks/serving")
    ap.add_argument("--workload", help="JSONL requests (genrec loadtest --make-workload; default: ML-1M's)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="the server configurations, side by side")
    ap.add_argument("--sender", choices=("auto", "native", "python"), default="auto",
                    help="who sends the load (genrec loadtest --sender); auto: native where it builds")
    ap.add_argument("--skip-crash", action="store_true", help="leave out the engine kill and shutdown runs")
    args = ap.parse_args()
    artifact, payloads = artifact_and_requests(Path(args.out), args.artifact)
    if args.workload:
        payloads = load_workload(args.workload)
    global SENDER
    SENDER, why = choose(args.sender)
    print(f"sender: {SENDER}" + (f" ({why})" if why else ""), flush=True)
    mine, generator = server_cpus()
    pin_process(generator)
    servers: dict[str, dict] = {}
    cap = 0.0
    for name in args.servers.split(","):
        extra = SERVERS[name]
        print(f"{name}:", flush=True)
        srv = start(artifact, extra)
        try:
            own, within, steps = capacity(srv.target, payloads, args.slo_p99_ms, args.step_s)
            cap = cap or own  # the first server's (the default's): the engine kill and shutdown runs' load
            servers[name] = {"capacity_qps": own, "capacity_within_slo_qps": within, "capacity_steps": steps,
                             "overload": overload(srv.target, srv.proc.pid, payloads, own, args.slo_p99_ms,
                                                  args.overload_s)}
            time.sleep(2)
            servers[name]["two_callers"] = two_callers(srv.target, payloads, own, args.overload_s)
        finally:
            srv.stop()
    payload = {"date": today(), "machine": machine(), "artifact": str(artifact), "slo_p99_ms": args.slo_p99_ms,
               "pinning": {"server_cpus": mine, "generator_cpus": generator}, "sender": SENDER,
               "capacity_qps": cap, "servers": servers}
    if args.skip_crash:  # (a probe: its JSON stays under --out)
        (Path(args.out) / "resilience-probe.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    else:
        payload.update(engine_kill=engine_kill(artifact, payloads, cap, 15.0), shutdown=shutdown(artifact, payloads, cap, 12.0))
        write_json("resilience", payload)
        update_results_md()
    print(json.dumps({k: v for k, v in payload.items() if k != "servers"}, indent=1, default=str)[:2000])


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
