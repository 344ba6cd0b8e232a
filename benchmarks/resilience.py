"""Resilience benchmark: the serving tier under overload, an engine crash and a shutdown.

One run, one artifact, ``genrec serve`` processes on 127.0.0.1 (engine process pinned to the
last CPU, the front-end and this load generator on the others), open-loop Poisson load:

* capacity: the most calls per second the default server answers, from a sweep of offered
  loads that stops once it answers less than 90% of what is offered (beside it, the highest
  step within the p99 budget, ``--slo-p99-ms``);
* overload: 2x and 4x that capacity offered for ``--overload-s`` each, against the default
  server (admission control on) and, side by side, one with it off (``--serve.batch.max_queue_ms=0``, no
  cap on concurrent calls: the queue alone bounds the backlog, as before admission control).
  Goodput (answered calls per second, and those within 2x the budget), how fast refusals came
  back, the admitted calls' p99, the server's memory;
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

from genrec.benchmarks.common import ROOT, machine, today, update_results_md, write_json
from genrec.benchmarks.serving import artifact_and_requests
from genrec.loadtest.runner import RESPONSES, run_step

STEPS = [50, 100, 150, 200, 300, 400, 500, 600, 800]
BATCHED = ["--serve.batch.max_batch=32", "--serve.batch.max_wait_ms=0", "--serve.process.poll_ms=1000"]
NO_ADMISSION = ["--serve.batch.max_queue_ms=0", "--serve.batch.max_queue=512", "--serve.connections.max_concurrent_rpcs=100000"]


class Server:
    """A ``genrec serve`` process: its address, the CPUs left for the load generator, and an
    event set once its standby engine has loaded."""

    def __init__(self, proc: subprocess.Popen, target: str, front: list[int]) -> None:
        self.proc, self.target, self.front = proc, target, front
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
    """A server process, its address and the CPUs left for the load generator."""
    cmd = [sys.executable, "-m", "genrec.cli", "serve", "--artifact", str(artifact), "--host", "127.0.0.1",
           "--port", "0", "--threads", "1", *BATCHED, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    front: list[int] = []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode})")
        if m := re.search(r"front-end on CPU (\S+)", line):
            front = [] if m.group(1) == "any" else [int(c) for c in m.group(1).split(",")]
        if m := re.search(r"on 127\.0\.0\.1:(\d+)$", line.strip()):
            return Server(proc, f"127.0.0.1:{m.group(1)}", front)
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
         calls: list | None = None, began: threading.Event | None = None) -> dict:
    """One open-loop step; ``began`` is set as it starts sending (its calls' times count from
    then, within a millisecond)."""
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
                     calls=calls)
    return asdict(r)


def capacity(target: str, payloads: list[bytes], slo_ms: float, seconds: float) -> tuple[float, float, list[dict]]:
    """(calls answered per second at most, the highest step within the p99 budget, the steps)."""
    steps, within, ok = [], 0.0, True
    for i, qps in enumerate(STEPS):
        r = step(target, payloads, qps, seconds, i, 1.0)
        steps.append(r)
        print(f"  capacity step {qps:g}: ok/s {r['achieved_qps']:.0f}, p99(all) {r['p99_all_ms']:.1f} ms", flush=True)
        ok = ok and r["p99_all_ms"] <= slo_ms
        within = qps if ok else within
        if r["ok"] < 0.9 * r["sent"] or r["p99_all_ms"] > 20 * slo_ms:  # saturated: answers lag or fail
            break
    return max(r["achieved_qps"] for r in steps), within, steps


def overload(target: str, pid: int, payloads: list[bytes], cap: float, slo_ms: float, seconds: float) -> list[dict]:
    out = []
    for mult in (2, 4):
        calls: list = []
        rss0 = rss_mb(pid)
        r = step(target, payloads, round(mult * cap), seconds, 100 + mult, 1.0, calls)
        within = sum(1 for _, took, code in calls if code == "OK" and took * 1e3 <= 2 * slo_ms)
        r.update(multiple=mult, goodput=r["ok"] / r["duration_s"], goodput_within_2x=within / r["duration_s"],
                 rss_before_mb=rss0, rss_after_mb=rss_mb(pid))
        print(f"  {mult}x ({round(mult * cap)} QPS): goodput {r['goodput']:.0f}/s ({r['goodput_within_2x']:.0f} within "
              f"{2 * slo_ms:g} ms), admitted p99 {r['p99_ms']:.1f} ms, refused p99 {r['refused_p99_ms']:.1f} ms, "
              f"errors {r['errors']}, RSS {rss0:.0f} -> {r['rss_after_mb']:.0f} MB", flush=True)
        out.append(r)
        time.sleep(2)
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
    args = ap.parse_args()
    artifact, payloads = artifact_and_requests(Path(args.out), args.artifact)
    servers: dict[str, dict] = {}
    cap = within = 0.0
    steps: list[dict] = []
    for name, extra in (("admission (default)", []), ("no admission", NO_ADMISSION)):
        print(f"{name}:", flush=True)
        srv = start(artifact, extra)
        if srv.front:
            os.sched_setaffinity(0, srv.front)
        try:
            if not cap:  # measured once, on the default server; both get the same offered loads
                cap, within, steps = capacity(srv.target, payloads, args.slo_p99_ms, args.step_s)
            servers[name] = {"overload": overload(srv.target, srv.proc.pid, payloads, cap, args.slo_p99_ms,
                                                  args.overload_s)}
        finally:
            srv.stop()
    payload = {"date": today(), "machine": machine(), "artifact": str(artifact), "slo_p99_ms": args.slo_p99_ms,
               "capacity_qps": cap, "capacity_within_slo_qps": within, "capacity_steps": steps,
               "servers": servers, "engine_kill": engine_kill(artifact, payloads, cap, 15.0),
               "shutdown": shutdown(artifact, payloads, cap, 12.0)}
    write_json("resilience", payload)
    update_results_md()
    print(json.dumps({k: v for k, v in payload.items() if k != "servers"}, indent=1, default=str)[:2000])


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
