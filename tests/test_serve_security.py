"""The serving tier's boundary: Admin on its own authenticated listener, artifact paths confined
to one folder and checked before any engine starts, every Admin failure a proper status, TLS,
and a shutdown that completes whatever state Admin was left in."""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from genrec.loadtest.client import RecommenderClient, user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.server import AdminConfig, ServeConfig, TLSConfig
from tests.serving_helpers import (
    ADMIN_TOKEN,
    ThreadedServer,
    admin_token_file,
    local_config,
    tiny_ranking_artifact,
)

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture(scope="module")
def root(tiny_synth, tmp_path_factory):
    """An artifact root holding one real artifact (``root / "live"``)."""
    out = tmp_path_factory.mktemp("security")
    art = tiny_ranking_artifact(tiny_synth, out)
    root = out / "artifacts"
    root.mkdir()
    shutil.copytree(art, root / "live")
    return root


@pytest.fixture(scope="module")
def server(root):
    cfg = local_config(admin=AdminConfig(token_file=admin_token_file()))
    srv = ThreadedServer(root / "live", cfg)
    yield srv
    srv.stop()


def admin_call(target: str, method: str, body: bytes, token: str | None = ADMIN_TOKEN,
               timeout: float = 30.0) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(f"/genrec.v1.Admin/{method}")
        md = (("authorization", f"Bearer {token}"),) if token is not None else ()
        try:
            call(body, timeout=timeout, metadata=md)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details() or ""


def load(srv: ThreadedServer, path: str, token: str | None = ADMIN_TOKEN) -> tuple[grpc.StatusCode, str]:
    return admin_call(srv.admin_target, "LoadArtifact", pb.LoadArtifactRequest(path=path).SerializeToString(), token)


def test_admin_is_not_served_on_the_public_port(server):
    code, _ = admin_call(server.target, "GetModelInfo", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED
    code, _ = admin_call(server.target, "LoadArtifact", pb.LoadArtifactRequest(path="live").SerializeToString())
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_admin_needs_the_token(server):
    assert admin_call(server.admin_target, "GetModelInfo", b"", token=None)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert admin_call(server.admin_target, "GetModelInfo", b"", token="wrong")[0] == grpc.StatusCode.PERMISSION_DENIED
    assert load(server, "live", token=None)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert admin_call(server.admin_target, "GetModelInfo", b"")[0] == grpc.StatusCode.OK
    assert server.client().info().tower == "hstu"
    # refused at the gate and answered by the handler: one label per method (they were
    # admin_GetModelInfo and admin_model_info)
    count = lambda code: server.server.metrics.requests.labels("admin_GetModelInfo", code)._value.get()  # noqa: E731
    assert count("UNAUTHENTICATED") >= 1 and count("PERMISSION_DENIED") >= 1 and count("OK") >= 2


def test_calls_without_the_token_that_never_send_a_body_hold_no_admin_slot(server):
    """Admin runs 8 calls at once. A unary handler runs only once the request has arrived, so a
    stranger's calls that send headers and then nothing held the 8 slots until their deadline
    and locked the operator out; the token is now checked on the headers alone."""
    stalled, calls = threading.Event(), []

    def never():  # a request stream that sends nothing until the test ends
        stalled.wait(30)
        return
        yield  # (a generator)

    with grpc.insecure_channel(server.admin_target) as ch:
        hang = ch.stream_unary("/genrec.v1.Admin/GetModelInfo")
        try:
            for md in [()] * 6 + [(("authorization", "Bearer wrong"),)] * 6:
                calls.append(hang.future(never(), timeout=30, metadata=md))
            time.sleep(1.0)
            code, detail = admin_call(server.admin_target, "GetModelInfo", b"", timeout=5)
            assert code == grpc.StatusCode.OK, (code, detail)
            codes = [c.exception().code() if c.done() and c.exception() else None for c in calls]
            assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}, codes
        finally:
            stalled.set()
            for c in calls:
                c.cancel()


def test_admin_never_shares_the_public_port(root):
    """gRPC sets SO_REUSEPORT by default: an Admin listener bound to the public port started
    without a word, and the kernel handed public callers to it (UNIMPLEMENTED) and Admin to the
    public. The same port in the config is refused; a port taken by the public listener (its
    port 0 resolved) fails Admin's bind."""
    with pytest.raises(ValueError, match="serve.admin.port = 50123 is serve.port"):
        ServeConfig(host="127.0.0.1", port=50123, admin=AdminConfig(token_file=admin_token_file(), port=50123))
    public = ThreadedServer(root / "live", local_config())
    try:
        cfg = local_config(admin=AdminConfig(token_file=admin_token_file(), port=int(public.target.rsplit(":", 1)[1])))
        with pytest.raises(Exception, match="(?i)bind|address|port"):
            ThreadedServer(root / "live", cfg)
    finally:
        public.stop()


def test_admin_is_off_without_a_token_file(root):
    from genrec.serve.server import RecommenderServer

    async def started() -> tuple[object, int]:
        srv = RecommenderServer(local_config(), str(root / "live"))
        await srv.start()
        await srv.stop(0)
        return srv.admin_server, srv.admin_port

    assert asyncio.run(started()) == (None, 0)


@pytest.mark.parametrize("path", ["../../../../../etc", "/etc", "/proc/self", "live/../../..", "/"])
def test_paths_outside_the_artifact_root_are_refused_before_any_engine_starts(server, path):
    before, engine = len(mp.active_children()), server.server.engine
    code, detail = load(server, path)
    assert code == grpc.StatusCode.PERMISSION_DENIED, detail
    assert "outside the artifact root" in detail
    assert server.server.engine is engine and len(mp.active_children()) == before


def test_a_symlink_out_of_the_root_is_refused(server, root, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(root / "live", outside)
    (root / "link").symlink_to(outside)
    try:
        assert load(server, "link")[0] == grpc.StatusCode.PERMISSION_DENIED
    finally:
        (root / "link").unlink()



@pytest.mark.parametrize("name", ["dense.safetensors", "manifest.json"])
def test_a_file_symlinked_out_of_the_root_is_refused_naming_it_and_the_root(server, root, tmp_path, name):
    """The folder lies below the root but one of its files is a symlink to a copy outside it:
    refused before any engine starts, naming the file and the root (what the manifest lists,
    and the manifest itself, are resolved)."""
    d = _bad_artifact(root, "escape")
    outside = tmp_path / name
    shutil.copy(root / "live" / name, outside)  # (the same bytes: only where it lies is wrong)
    (d / name).unlink()
    (d / name).symlink_to(outside)
    before, engine = len(mp.active_children()), server.server.engine
    code, detail = load(server, "escape")
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, detail)
    assert name in detail and "outside the artifact root" in detail and str(root.resolve()) in detail
    assert server.server.engine is engine and len(mp.active_children()) == before
    from genrec.quant.artifact import OutsideRoot, check_artifact

    with pytest.raises(OutsideRoot, match=name):
        check_artifact(d, root)
    check_artifact(d)  # (no root: an operator's own artifact may link its files anywhere)


def test_an_admin_token_file_others_can_read_or_write_is_refused_before_an_engine_starts(tmp_path):
    from genrec.serve.server import RecommenderServer

    token = tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    for mode in (0o644, 0o640, 0o604, 0o620, 0o602):
        token.chmod(mode)
        cfg = local_config(admin=AdminConfig(token_file=str(token)))
        with pytest.raises(ValueError, match=f"{re.escape(str(token))}.*chmod 600"):
            RecommenderServer(cfg, str(tmp_path / "no-artifact"))  # (refused before the artifact is opened)
    token.chmod(0o600)
    with pytest.raises(Exception) as e:  # the token passes; the missing artifact is what fails now
        RecommenderServer(local_config(admin=AdminConfig(token_file=str(token))), str(tmp_path / "no-artifact"))
    assert "chmod" not in str(e.value)


def _bad_artifact(root: Path, name: str) -> Path:
    d = root / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(root / "live", d)
    return d


def test_malformed_artifacts_get_failed_precondition_and_never_open_a_foreign_file(server, root):
    cases = {}
    d = _bad_artifact(root, "traversal")  # a manifest naming a file outside its folder
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["../../../../../etc/passwd"] = m["files"].pop("dense.safetensors")
    (d / "manifest.json").write_text(json.dumps(m))
    cases["traversal"] = "etc/passwd"
    d = _bad_artifact(root, "fifo")  # a FIFO named manifest.json: opening it would block
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")
    cases["fifo"] = "not a regular file"
    d = _bad_artifact(root, "dir")
    (d / "manifest.json").unlink()
    (d / "manifest.json").mkdir()
    cases["dir"] = "not a regular file"
    d = _bad_artifact(root, "keys")
    m = json.loads((d / "manifest.json").read_text())
    del m["model"]
    (d / "manifest.json").write_text(json.dumps(m))
    cases["keys"] = "lacks the key 'model'"
    d = _bad_artifact(root, "truncated")
    with open(d / "dense.safetensors", "r+b") as f:
        f.truncate(100)
    cases["truncated"] = "truncated"
    d = _bad_artifact(root, "notjson")
    (d / "manifest.json").write_bytes(b"\xff\xfe{")
    cases["notjson"] = "not valid JSON"
    cases["missing"] = "no manifest.json"
    (root / "missing").mkdir(exist_ok=True)
    engine = server.server.engine
    for name, words in cases.items():
        code, detail = load(server, name)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (name, code, detail)
        assert words in detail, (name, detail)
    assert server.server.engine is engine


def test_odd_requests_get_a_status_never_unknown(server, root):
    long_name = "a" * 10_000
    assert load(server, long_name)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert load(server, "")[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert load(server, "x\0y")[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, detail = load(server, "does-not-exist-" + "b" * 3000)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and len(detail) <= 512
    for body in (b"\xff\xff\xff", b"\x0a\xff", b"\x08" * 3):
        assert admin_call(server.admin_target, "GetModelInfo", body)[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert admin_call(server.admin_target, "LoadArtifact", body)[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_fuzzed_admin_calls_never_get_unknown_or_internal(server):
    rng = random.Random(7)
    valid = pb.LoadArtifactRequest(path="nowhere").SerializeToString()
    seen = set()
    for i in range(300):
        body = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.4 and body:
                body[rng.randrange(len(body))] = rng.randrange(256)
            elif op < 0.7:
                body = body[: rng.randrange(len(body) + 1)]
            else:
                body += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        token = [ADMIN_TOKEN, None, "x" * 40][i % 3]
        for method in ("GetModelInfo", "LoadArtifact"):
            code, _ = admin_call(server.admin_target, method, bytes(body), token)
            assert code not in BAD, (method, bytes(body), code)
            seen.add(code)
    assert {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED} <= seen


def load_under_way(srv: ThreadedServer, path: str) -> tuple[threading.Thread, list]:
    """A LoadArtifact of ``path`` started in a thread, returned once the server has taken its
    reload lock (the artifact checked, the engine starting); its result lands in the list."""
    results: list = []
    t = threading.Thread(target=lambda: results.append(load(srv, path)))
    t.start()
    deadline = time.monotonic() + 30
    while not srv.server._reloading.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    return t, results


def test_a_second_load_while_one_runs_is_refused_and_one_engine_stays(root):
    """(One engine: its serving process and its standby.)"""
    cfg = ServeConfig(host="127.0.0.1", port=0, engine_process=True)
    srv = ThreadedServer(root / "live", cfg)
    try:
        t, results = load_under_way(srv, "live")
        code, detail = load(srv, "live")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "in progress" in detail
        t.join(120)
        assert results[0][0] == grpc.StatusCode.OK
        deadline = time.monotonic() + 60  # the replaced engine's processes stop after their batch
        while len([c for c in mp.active_children() if c.name.startswith("genrec-engine")]) > 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        srv.stop()


def test_an_artifact_swapped_for_another_after_its_check_is_not_served(tmp_path):
    """The root check runs on the folder; the engine re-opens it by name seconds later. A folder
    swapped in between (for a symlink out of the root, by whoever can write below it) loads
    another model: it must not be served (its model_version differs from the one checked)."""
    from genrec.quant.artifact import read_manifest
    from genrec.serve.catalogue import version_of
    from genrec.serve.worker import ProcessSettings
    from tests.serving_helpers import untrained_artifact

    root, outside = tmp_path / "root", tmp_path / "outside"
    live = untrained_artifact(root / "live")
    shutil.copytree(live, root / "upload")
    other = untrained_artifact(outside / "other", seed=1)
    cfg = local_config(engine_process=True, process=ProcessSettings(threads=1, standby=False),
                       admin=AdminConfig(token_file=admin_token_file(), artifact_root=str(root)))
    srv = ThreadedServer(live, cfg)
    try:
        t, results = load_under_way(srv, "upload")  # (the check has passed: the engine process is starting)
        os.rename(root / "upload", root / "upload.old")
        os.symlink(other, root / "upload")
        t.join(120)
        code, detail = results[0]
        assert code == grpc.StatusCode.ABORTED and "changed between its check" in detail
        assert srv.server.engine.version == version_of(read_manifest(live))
    finally:
        srv.stop()


def _self_signed(tmp: Path, name: str) -> tuple[Path, Path]:
    key, cert = tmp / f"{name}.key", tmp / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make test certificates")
def test_tls_and_mutual_tls_on_the_public_port(root, tmp_path):
    key, cert = _self_signed(tmp_path, "server")
    ckey, ccert = _self_signed(tmp_path, "client")
    u = user([(5, T0, 1), (9, T0 + 60, 1)], {"region": [2]})
    srv = ThreadedServer(root / "live", local_config(tls=TLSConfig(str(cert), str(key))))
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        assert len(RecommenderClient(srv.target, 10, credentials=creds).retrieve(u, k=3).items) == 3
        with pytest.raises(grpc.RpcError) as e:  # plaintext to a TLS port
            RecommenderClient(srv.target, 3).retrieve(u, k=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # Admin shares the server's certificate unless it has its own
        admin = RecommenderClient(srv.target, 10, admin_target=srv.admin_target, admin_token=ADMIN_TOKEN,
                                  credentials=creds)
        assert admin.info().tower == "hstu"
    finally:
        srv.stop()
    mtls = TLSConfig(str(cert), str(key), client_ca=str(ccert))
    srv = ThreadedServer(root / "live", local_config(tls=mtls))
    try:
        anonymous = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with pytest.raises(grpc.RpcError) as e:
            RecommenderClient(srv.target, 3, credentials=anonymous).retrieve(u, k=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        known = grpc.ssl_channel_credentials(cert.read_bytes(), ckey.read_bytes(), ccert.read_bytes())
        assert len(RecommenderClient(srv.target, 10, credentials=known).retrieve(u, k=3).items) == 3
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_sigterm_under_load_with_a_load_in_progress_answers_admitted_calls_and_exits(root, tmp_path):
    token = admin_token_file()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "genrec.cli", "serve", "--artifact", str(root / "live"),
                             "--host", "127.0.0.1", "--port", "0", "--threads", "1", f"--serve.admin.token_file={token}",
                             "--serve.grace_s=5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        port = admin = None
        deadline = time.time() + 120
        while time.time() < deadline and not (port and admin):
            line = proc.stdout.readline()
            if m := re.search(r"on 127\.0\.0\.1:(\d+)$", line.strip()):
                port = int(m.group(1))
            if m := re.search(r"admin on 127\.0\.0\.1:(\d+)", line):
                admin = int(m.group(1))
        assert port and admin, "server did not start"
        threading.Thread(target=lambda: [_ for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
        c = RecommenderClient(f"127.0.0.1:{port}", 20, admin_target=f"127.0.0.1:{admin}", admin_token=ADMIN_TOKEN)
        u = user([(5, T0, 1), (9, T0 + 60, 1)], {"region": [2]})
        codes: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    c.retrieve(u, k=3)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)

        workers = [threading.Thread(target=traffic) for _ in range(3)]
        for w in workers:
            w.start()
        loading = threading.Thread(target=lambda: codes.append(_load_code(c, str(root / "live"))))
        loading.start()
        time.sleep(1.0)  # the new engine process is starting
        kids = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5 + 30) == 0
        stop.set()
        for w in workers:
            w.join(30)
        loading.join(30)
        assert "OK" in codes
        # admitted calls were answered; later ones were refused as the server went away, or by
        # admission while the new engine process loaded beside the serving one on a busy host
        # (RESOURCE_EXHAUSTED: a refusal before any work, never a dropped admitted call)
        assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED", "RESOURCE_EXHAUSTED"}, set(codes)
        time.sleep(0.5)
        assert not [k for k in kids if Path(f"/proc/{k}").exists() and "zombie" not in _state(k)], "engine left running"
    finally:
        if proc.poll() is None:
            proc.kill()


def _load_code(c: RecommenderClient, path: str) -> str:
    try:
        c.load_artifact(path)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def test_batch_cost_model_recovers_a_fixed_and_a_per_call_part():
    from genrec.serve.batcher import BatchCost

    cost = BatchCost()
    assert cost.coefficients() is None and cost.wait(3, 30) == 0.0
    cost.observe(2, 0.003)  # one size only: the batch mean, no per-call part
    assert cost.coefficients() == pytest.approx((0.003, 0.0))
    for size in (1, 2, 4, 8, 16, 32) * 5:
        cost.observe(size, 0.002 + 0.0005 * size)
    a, c = cost.coefficients()
    assert a == pytest.approx(0.002, rel=0.1) and c == pytest.approx(0.0005, rel=0.1)
    assert cost.wait(2, 10) == pytest.approx(2 * a + 10 * c)


def test_admission_spreads_the_wait_over_batches_an_engine_runs_together():
    """SGLang merges the batches in flight into its own: a call does not wait for them one by one."""
    from genrec.serve.batcher import BatchConfig, Batcher

    async def waits() -> tuple[float, float]:
        out = []
        for together in (False, True):
            engine = SimpleNamespace(batches_together=together, parallel=1)
            b = Batcher(lambda e=engine: e, BatchConfig(max_batch=4, max_queue=100, max_queue_ms=10, max_inflight=4))
            for _ in range(20):
                b.cost.observe(1, 0.015)  # 15 ms a call (fitted as a batch's fixed cost)
            b.inflight_calls, b.running = 2, {1, 2}
            out.append(b.predicted_wait())
        return out[0], out[1]

    serial, together = asyncio.run(waits())
    assert together == pytest.approx(serial / 4)


def test_admission_refuses_at_once_what_could_not_start_in_time():
    from genrec.serve.batcher import BatchConfig, Batcher, Overloaded

    async def scenario() -> list[str]:
        engine = SimpleNamespace(batches_together=False, parallel=1)
        b = Batcher(lambda: engine, BatchConfig(max_batch=4, max_queue=100, max_queue_ms=10))

        def fill(n: int) -> None:
            b.queues.setdefault("", collections.deque()).extend([(None, None)] * n)
            b.queued += n

        out = []
        now = time.monotonic()
        b.admit(now + 1)  # nothing known yet: admitted
        for _ in range(20):
            b.cost.observe(4, 0.008)  # 2 ms a call
        b.admit(now + 1)  # empty queue: ~2 ms to finish
        fill(4)  # 8 ms of work ahead: within 10 ms
        b.admit(now + 1)
        try:
            b.admit(now + 0.005)  # but not within this caller's 5 ms
        except Overloaded as e:
            out.append(str(e))
        fill(2)  # 12 ms ahead: past max_queue_ms
        try:
            b.admit(now + 1)
        except Overloaded as e:
            out.append(str(e))
        b.queues.clear()
        b.queued = 0
        b.inflight_calls = 8  # two batches of four in the engine: 16 ms
        b.running = {1, 2}
        try:
            b.admit(now + 1)
        except Overloaded as e:
            out.append(str(e))
        return out

    refusals = asyncio.run(scenario())
    assert len(refusals) == 3
    assert "deadline" in refusals[0] and "10 ms" in refusals[1] and "10 ms" in refusals[2]


def test_an_idle_server_admits_a_call_past_a_slow_batch():
    """One cold batch (a long history's first prefill) must not refuse every later call: an
    idle server tries the call, and its cost is learned again."""
    from genrec.serve.batcher import BatchConfig, Batcher

    async def scenario() -> None:
        engine = SimpleNamespace(batches_together=False, parallel=1)
        b = Batcher(lambda: engine, BatchConfig(max_batch=4, max_queue=100, max_queue_ms=20))
        b.cost.observe(1, 2.0)  # a cold 2 s batch
        b.admit(time.monotonic() + 1.0)  # idle: admitted although 2 s > the 1 s deadline

    asyncio.run(scenario())


def test_error_details_are_ascii_and_bounded_and_the_message_limit_fits_the_request_limits():
    from genrec.serve.requests import Limits
    from genrec.serve.server import ConnectionConfig, _server_options, bounded

    detail = bounded("name 'é" + "x" * 2000 + "'")
    assert detail.isascii() and len(detail) == 512 and detail.endswith("...") and "\\xe9" in detail
    options = dict(_server_options(ConnectionConfig(), Limits()))
    assert options["grpc.max_receive_message_length"] > Limits().request_bytes()
    with pytest.raises(ValueError, match="max_message_bytes"):
        _server_options(ConnectionConfig(max_message_bytes=1000), Limits())


def test_batch_cost_model_forgets_a_burst_of_cold_batches():
    """A fresh cache's first calls encode whole long histories (seconds each); the warm calls
    after them cost milliseconds. The model predicts the warm cost once they are most of its
    recent batches (the exponential mean alone still predicted ~1 s after 20 warm batches), a
    rare cold batch among warm ones does not move it, and a mix of costs is kept whole."""
    from genrec.serve.batcher import BatchCost

    cost = BatchCost()
    for _ in range(49):
        cost.observe(1, 2.0)  # cold: an 8,000-event history encoded whole
    for _ in range(20):
        cost.observe(1, 0.015)  # warm: a few new events on the cached history
    assert cost.coefficients()[0] == pytest.approx(0.015)
    for _ in range(20):
        cost.observe(1, 0.015)
    cost.observe(1, 2.0)  # one cold call among warm ones (the burst out of the recent batches)
    assert cost.coefficients()[0] == pytest.approx(0.015)
    mixed, plain = BatchCost(), BatchCost(window=1, outlier=1e9)  # (plain: the exponential mean alone)
    for i in range(64):
        for m in (mixed, plain):
            m.observe(1, 0.1 if i % 5 == 0 else 0.01)  # a fifth of the calls 10x the rest
    assert mixed.coefficients() == pytest.approx(plain.coefficients())


def test_batch_cost_model_is_the_exponential_fit_while_batches_look_alike():
    """Under steady load (batch sizes 1-32, each batch's cost up to 2x off its size's mean) the
    guards never act: the model is the exponential least-squares fit admission always used."""
    import random

    from genrec.serve.batcher import BatchCost

    rng = random.Random(0)
    guarded, plain = BatchCost(), BatchCost(window=1, outlier=1e9)
    for _ in range(500):
        b = rng.randint(1, 32)
        t = (0.002 + 0.0005 * b) * rng.uniform(0.5, 2.0)
        guarded.observe(b, t)
        plain.observe(b, t)
    assert guarded.coefficients() == pytest.approx(plain.coefficients(), rel=1e-12)
