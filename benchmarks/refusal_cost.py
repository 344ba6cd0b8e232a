"""What one refused call costs a Python gRPC front-end, by server kind (issue 46).

    python -m genrec.benchmarks.refusal_cost [--calls 4000] [--reps 3]

A server process pinned to the last CPU, a grpc.aio client pinned to another (64 calls in flight),
one unary method. The figure is the server process's CPU time (user + system, from
/proc/<pid>/stat) over ``--calls`` calls, per call, after a 200-call warm-up; every call is
refused with RESOURCE_EXHAUSTED. Kinds:

* ``aio-abort``: ``grpc.aio`` server, the handler aborts (what genrec's admission does);
* ``aio-limit``: ``grpc.aio`` with ``maximum_concurrent_rpcs=1`` and one call held: the rest are
  refused by grpc's Cython layer after being accepted (``_handle_rpc``'s concurrency check);
* ``sync-abort``: the thread-pool server (``grpc.server``), the handler aborts on a pool thread;
* ``sync-limit``: the thread-pool server with ``maximum_concurrent_rpcs=1`` and one call held:
  the rest are refused on the polling thread before any handler or pool thread runs.

Why it matters: on the one CPU the server has, an answered call costs ~1/capacity (about 2 ms
at 500/s); at 4x capacity three refusals come with every answer, so goodput is bounded by
1 / (1 + 3 x refusal / answer). An exploration, not a target: the JSON goes to ``--out``
(default under runs/), the figures into benchmarks/notes/2026-12-05-refusal-cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("aio-abort", "aio-limit", "sync-abort", "sync-limit")

SERVER = r'''
import asyncio, sys, time
from concurrent import futures
import grpc
kind, port = sys.argv[1], int(sys.argv[2])
limit = 1 if kind.endswith("limit") else None
if kind.startswith("sync"):
    def unary(request, context):
        if kind == "sync-abort":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")
        time.sleep(60)  # (sync-limit: the one call held; the others are refused)
        return b""
    handler = grpc.method_handlers_generic_handler("b.S", {"M": grpc.unary_unary_rpc_method_handler(unary)})
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler], maximum_concurrent_rpcs=limit)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()
else:
    async def unary(request, context):
        if kind == "aio-abort":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")
        await asyncio.sleep(60)
        return b""
    handler = grpc.method_handlers_generic_handler("b.S", {"M": grpc.unary_unary_rpc_method_handler(unary)})
    async def main():
        server = grpc.aio.server(handlers=[handler], maximum_concurrent_rpcs=limit)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())
'''

CLIENT = r'''
import asyncio, sys, grpc
port, n = int(sys.argv[1]), int(sys.argv[2])
async def main():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method, gate, codes = channel.unary_unary("/b.S/M"), asyncio.Semaphore(64), {}
        async def one():
            async with gate:
                try:
                    await method(b"", timeout=5)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                codes[code] = codes.get(code, 0) + 1
        await asyncio.gather(*[one() for _ in range(n)])
        print(codes)
asyncio.run(main())
'''


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pinned(cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu)] if cpu is not None else []


def one(kind: str, calls: int, port: int, server_cpu: int | None, client_cpu: int | None) -> dict:
    srv = subprocess.Popen([*pinned(server_cpu), sys.executable, "-c", SERVER, kind, str(port)],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        client = [*pinned(client_cpu), sys.executable, "-c", CLIENT, str(port)]
        subprocess.run([*client, "200"], check=True, capture_output=True)
        before, t0 = cpu_s(srv.pid), time.perf_counter()
        out = subprocess.run([*client, str(calls)], check=True, capture_output=True, text=True).stdout
        used, wall = cpu_s(srv.pid) - before, time.perf_counter() - t0
    finally:
        srv.kill()
        srv.wait()
    return {"kind": kind, "calls": calls, "server_cpu_us_per_call": used / calls * 1e6, "wall_s": wall,
            "codes": out.strip()}


def main() -> None:
    import grpc

    from genrec.benchmarks.common import ROOT, machine, today

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=50998)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "refusal_cost.json")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[-1], cpus[0]) if len(cpus) > 1 else (None, None)
    rows = [one(k, args.calls, args.port, server_cpu, client_cpu) for _ in range(args.reps) for k in KINDS]
    per = {k: sorted(r["server_cpu_us_per_call"] for r in rows if r["kind"] == k) for k in KINDS}
    median = {k: v[len(v) // 2] for k, v in per.items()}
    payload = {"date": today(), "machine": machine(), "load_average": list(os.getloadavg()),
               "grpc": grpc.__version__, "command": "python -m genrec.benchmarks.refusal_cost " + " ".join(sys.argv[1:]),
               "pinning": {"server_cpu": server_cpu, "client_cpu": client_cpu}, "rows": rows,
               "median_us_per_call": median,
               "vs_aio_abort": {k: v / median["aio-abort"] for k, v in median.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    for k in KINDS:
        print(f"{k:11s} {median[k]:7.1f} us/call  ({payload['vs_aio_abort'][k]:.2f}x aio-abort)")
    print(args.out)


if __name__ == "__main__":
    main()
