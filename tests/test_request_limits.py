"""The public API's request boundary: every repeated field bounded before the work it causes,
error details bounded, exclude_items and long histories honoured by every engine, and a
fuzz of the three calls over random and mutated bytes that never gets UNKNOWN or INTERNAL."""

from __future__ import annotations

import random
import threading
import time

import grpc
import numpy as np
import pytest

import genrec.serve.requests as requests
from genrec.benchmarks.naive_engine import NaiveTorchEngine
from genrec.loadtest.client import user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.batcher import BatchConfig
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import MAX_DETAIL, InvalidRequest, Limits, decode
from tests.serving_helpers import SlowEngine, ThreadedServer, local_config, tiny_ranking_artifact

T0 = 1_700_000_000
CTX = {"region": [3]}


@pytest.fixture(scope="module")
def artifact(tiny_synth, tmp_path_factory):
    return tiny_ranking_artifact(tiny_synth, tmp_path_factory.mktemp("limits"))


@pytest.fixture(scope="module")
def engine(artifact):
    return TorchEngine(artifact)


def events(n: int, seed: int = 0, lo: int = 1, hi: int = 600) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(lo, hi), T0 + 60 * i, rng.choice([1, 3])) for i in range(n)]


def calls(target: str) -> tuple[grpc.Channel, dict]:
    ch = grpc.insecure_channel(target)
    return ch, {m: ch.unary_unary(f"/genrec.v1.Recommender/{m}") for m in ("Recommend", "Retrieve", "Rank")}


def status(call, data: bytes) -> tuple[grpc.StatusCode, str, bytes | None]:  # noqa: ANN001
    try:
        return grpc.StatusCode.OK, "", call(data, timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


# ---- bounded error details ------------------------------------------------------------------
def test_errors_quote_a_request_string_briefly_and_are_capped(engine):
    """A 10,000-character feature name (or objective) is INVALID_ARGUMENT naming the field with a
    short quote, not RESOURCE_EXHAUSTED from a status detail over gRPC's 8 KB header limit."""
    long_name, odd = "x" * 10_000, "\u00e9\u2603%\n" * 3000
    reqs = {"user.context[0].name": pb.RecommendRequest(user=user(events(3), {long_name: [1]})),
            "objective": pb.RecommendRequest(user=user(events(3), CTX), objective=odd)}
    for field, req in reqs.items():
        with pytest.raises(InvalidRequest) as e:
            decode("recommend", req.SerializeToString(), engine.schema, Limits())
        msg = str(e.value)
        assert msg.startswith(field) and len(msg) < 300 and msg.isascii() and "..." in msg, msg
    assert len(str(InvalidRequest("y" * 100_000))) == MAX_DETAIL
    assert str(InvalidRequest("\u2603")) == "\\u2603"  # ASCII: nothing for gRPC to percent-encode
    srv = ThreadedServer(engine.artifact, local_config(), engine=engine)
    try:
        ch, rpc = calls(srv.target)
        for field, req in reqs.items():
            code, details, _ = status(rpc["Recommend"], req.SerializeToString())
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), (code, details[:200])
            assert len(details) <= MAX_DETAIL
        ch.close()
    finally:
        srv.stop()


# ---- every count checked before the work it causes ------------------------------------------
class Conversions:
    """Counts element-wise conversions decode() makes: np.fromiter calls and id checks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        fromiter, prepare = np.fromiter, requests.prepare_ids

        def counted_fromiter(*a, **k):  # noqa: ANN002, ANN003, ANN202
            self.n += 1
            return fromiter(*a, **k)

        def counted_prepare(*a, **k):  # noqa: ANN002, ANN003, ANN202
            self.n += 1
            return prepare(*a, **k)

        monkeypatch.setattr(np, "fromiter", counted_fromiter)
        monkeypatch.setattr(requests, "prepare_ids", counted_prepare)


def test_each_repeated_field_over_its_limit_is_refused_before_any_element_is_converted(engine, monkeypatch):
    lim = Limits(max_history=40, max_candidates=8, max_exclude_items=6, max_context_features=2, max_context_ids=5)
    ok, many = events(40), events(41)
    cands = [pb.Candidate(item_id=i, bid=1.0) for i in range(1, 10)]
    over = {  # field named -> (kind, request): the rest of each request is valid and large
        "user.history": ("retrieve", pb.RetrieveRequest(user=user(many, CTX), exclude_items=[1, 2])),
        "user.history_columns.item_ids": ("retrieve", pb.RetrieveRequest(user=user(many, CTX, columns=True))),
        "user.history_columns.timestamps": ("retrieve", pb.RetrieveRequest(user=pb.User(
            history_columns=pb.EventColumns(item_ids=[1] * 40, timestamps=[T0] * 41)))),
        "user.context": ("recommend", pb.RecommendRequest(user=pb.User(
            history=user(ok).history, context=[pb.ContextFeature(name="region", ids=[1])] * 3))),
        "user.context[1].ids": ("recommend", pb.RecommendRequest(user=pb.User(
            history=user(ok).history, context=[pb.ContextFeature(name="region", ids=[1]),
                                               pb.ContextFeature(name="region", ids=list(range(6)))]))),
        "candidates": ("rank", pb.RankRequest(user=user(ok, CTX), candidates=cands)),
        "exclude_items": ("recommend", pb.RecommendRequest(user=user(ok, CTX), exclude_items=list(range(1, 8)))),
    }
    counter = Conversions(monkeypatch)
    for field, (kind, req) in over.items():
        counter.n = 0
        with pytest.raises(InvalidRequest, match="^" + field.replace("[", r"\[").replace("]", r"\]") + ": has "):
            decode(kind, req.SerializeToString(), engine.schema, lim)
        assert counter.n == 0, f"{field}: {counter.n} conversions before the refusal"
    # at the limits themselves every request above is served
    counter.n = 0
    at = pb.RecommendRequest(user=pb.User(history=user(ok).history, context=[pb.ContextFeature(name="region", ids=[1] * 5)]),
                             exclude_items=list(range(1, 7)), candidates=cands[:8])
    work = decode("recommend", at.SerializeToString(), engine.schema, lim)
    assert work.exclude_items.size == 6 and work.candidates.size == 8 and counter.n > 0


def test_a_request_longer_than_its_limits_allow_is_refused_before_it_is_parsed(engine, monkeypatch):
    parsed = []
    parse = requests.parse
    monkeypatch.setattr(requests, "parse", lambda cls, data: parsed.append(cls) or parse(cls, data))
    # 10^6 events as packed columns (~4 MB): refused on its size, nothing parsed
    big = pb.RetrieveRequest(user=pb.User(history_columns=pb.EventColumns(item_ids=np.full(10**6, 7)))).SerializeToString()
    with pytest.raises(InvalidRequest, match=r"^request: \d+ bytes, more than the \d+"):
        decode("retrieve", big, engine.schema, Limits())
    assert parsed == []
    # 3 x 10^6 context ids: the same
    ctx = pb.RecommendRequest(user=pb.User(history=user(events(5)).history, context=[pb.ContextFeature(
        name="region", ids=np.ones(3 * 10**6, np.int64))])).SerializeToString()
    with pytest.raises(InvalidRequest, match="^request: "):
        decode("recommend", ctx, engine.schema, Limits())
    assert parsed == []
    assert Limits(max_request_bytes=100).request_bytes() == 100


def _largest(lim: Limits) -> list[tuple[bytes, int]]:
    """The longest Recommend and Retrieve requests ``lim`` allows (every count at its limit,
    every value at its longest valid encoding: ids near 2^63, 256-character names), and how
    many bytes longer each is sent unpacked (valid too: a tag byte per repeated scalar)."""
    big, name = 2**63 - 1, "n" * 256
    ctx = [pb.ContextFeature(name=name, ids=[big] * lim.max_context_ids)] * lim.max_context_features
    hist = [pb.Event(item_id=big, timestamp=big, actions=2**32 - 1)] * lim.max_history
    cands = [pb.Candidate(item_id=big, bid=1e300)] * lim.max_candidates
    excl = [big] * lim.max_exclude_items
    unpacked = lim.max_context_features * lim.max_context_ids + lim.max_exclude_items
    rec = pb.RecommendRequest(user=pb.User(history=hist, context=ctx, request_time=big), retrieve_k=2**32 - 1,
                              top_k=2**32 - 1, candidates=cands, exclude_history=False, objective=name, exclude_items=excl)
    cols = pb.EventColumns(item_ids=[big] * lim.max_history, timestamps=[big] * lim.max_history,
                           actions=[2**32 - 1] * lim.max_history)
    ret = pb.RetrieveRequest(user=pb.User(history_columns=cols, context=ctx, request_time=big), k=2**32 - 1,
                             exclude_history=True, exclude_items=excl)
    return [(rec.SerializeToString(), unpacked), (ret.SerializeToString(), unpacked + 3 * lim.max_history)]


def test_the_largest_request_the_limits_allow_is_within_their_byte_bound():
    """request_bytes() must not refuse a request its counts allow: checked with each count
    large alone (so that its share of the bound, not the bound's slack, must cover it) and all
    together."""
    one = dict(max_history=1, max_candidates=1, max_exclude_items=1, max_context_features=1, max_context_ids=1)
    large = dict(max_history=2000, max_candidates=2000, max_exclude_items=5000, max_context_ids=3000)
    variants = [Limits(**one), Limits(**{**one, "max_context_features": 60, "max_context_ids": 3}), Limits()]
    variants += [Limits(**{**one, key: value}) for key, value in large.items()]
    for lim in variants:
        for data, unpacked in _largest(lim):
            assert len(data) + unpacked <= lim.request_bytes(), (lim, len(data) + unpacked, lim.request_bytes())
            requests._size(data, lim)  # not refused on its size



# ---- the longest deadline honoured ------------------------------------------------------------


def test_a_client_deadline_past_max_deadline_ms_is_clamped_so_no_queued_call_waits_longer(artifact, engine):
    """Clients send a 60 s deadline; the server holds no call longer than limits.max_deadline_ms
    (here 400 ms): behind a 1.5 s batch, each queued call ends (DEADLINE_EXCEEDED, or refused at
    admission) by the bound, unrun, instead of waiting its turn for seconds."""
    bound = 0.4
    slow = SlowEngine(engine, delay=1.5)
    cfg = local_config(limits=Limits(max_deadline_ms=bound * 1e3),
                       batch=BatchConfig(max_batch=1, max_wait_ms=0, max_inflight=1, max_queue_ms=0))
    srv = ThreadedServer(artifact, cfg, engine=slow)
    ch, rpc = calls(srv.target)
    try:
        body = pb.RetrieveRequest(user=user(events(5), CTX), k=5).SerializeToString()
        out: list[tuple[grpc.StatusCode, float]] = []

        def one() -> None:
            t = time.monotonic()
            code = status(rpc["Retrieve"], body)[0]  # (a 60 s client deadline)
            out.append((code, time.monotonic() - t))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == 4
        assert {c for c, _ in out} <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}, out
        assert max(s for _, s in out) < bound + 0.6, out  # well before the first batch (1.5 s) ends
        time.sleep(1.6)
        assert slow.works_run <= 1  # only the first started; the queued ones were dropped unrun
    finally:
        ch.close()
        srv.stop()


# ---- exclude_items and histories longer than the window -------------------------------------
def _ids(result) -> list[int]:  # noqa: ANN001
    return [int(i) for i in result.item_ids]


@pytest.mark.parametrize("path", ["native", "packed", "jagged", "naive"])
def test_every_engine_drops_exclude_items_from_retrieval(artifact, engine, path):
    e = {"native": lambda: engine, "packed": lambda: TorchEngine(artifact, native=False),
         "jagged": lambda: TorchEngine(artifact, packed=False), "naive": lambda: NaiveTorchEngine(artifact)}[path]()
    if path == "native" and e.path != "native":
        pytest.skip("the native library does not build here")
    u = user(events(6), CTX)

    def run(kind: str, **kw) -> list:  # noqa: ANN003
        req = (pb.RetrieveRequest(user=u, k=30, **kw) if kind == "retrieve"
               else pb.RecommendRequest(user=u, retrieve_k=30, top_k=10, **kw))
        return e.run([decode(kind, req.SerializeToString(), e.schema, Limits())])[0]

    first = _ids(run("retrieve"))
    outside = sorted(set(range(1, 600)) - {int(i) for i in e.corpus_np})[:2]  # in the table, not the catalogue
    block = first[:12] + outside  # the best 12
    for kind in ("retrieve", "recommend"):
        for keep_history in (False, True):
            got = _ids(run(kind, exclude_items=block, exclude_history=not keep_history))
            assert got and not set(got) & set(block), (kind, keep_history)
            if not keep_history:
                assert not set(got) & {h for h, _, _ in events(6)}
    # the rest of the ranking is unchanged: the next 18 retrieved, in order
    assert _ids(run("retrieve", exclude_items=first[:12]))[:18] == first[12:]
    # everything excluded: nothing comes back (no -inf scores, no crash in ranking)
    everything = [int(i) for i in e.corpus_np]
    lim = Limits(max_exclude_items=len(everything))
    for kind, req in (("retrieve", pb.RetrieveRequest(user=u, k=30, exclude_items=everything)),
                      ("recommend", pb.RecommendRequest(user=u, retrieve_k=30, top_k=10, exclude_items=everything))):
        assert _ids(e.run([decode(kind, req.SerializeToString(), e.schema, lim)])[0]) == []


def test_exclude_items_out_of_the_table_are_invalid_argument(engine):
    u = user(events(3), CTX)
    for bad, at in ((-1, 0), (10**9, 1)):
        req = pb.RetrieveRequest(user=u, exclude_items=[5, bad] if at else [bad])
        with pytest.raises(InvalidRequest, match=rf"^exclude_items\[{at}\]: "):
            decode("retrieve", req.SerializeToString(), engine.schema, Limits())


def test_a_history_longer_than_the_window_is_served_on_its_latest_events_and_excluded_whole(artifact, engine):
    """Through a real server: 400 events (> 10x the tiny model's window of 31) are accepted; the
    answer is the one for the latest 31 with the earlier items sent as exclude_items (events
    before the window without a time do not turn the window's times off); no item of the 400
    comes back; exclude_items are honoured over gRPC for Recommend and Retrieve."""
    window = engine.schema.max_history
    long = [(i, 0 if j < 100 else t, a) for j, (i, t, a) in enumerate(events(400, seed=5))]
    assert len(long) > 10 * window
    srv = ThreadedServer(artifact, local_config(), engine=engine)
    try:
        ch, rpc = calls(srv.target)
        sent = {h for h, _, _ in long}
        for columns in (False, True):
            req = pb.RetrieveRequest(user=user(long, CTX, columns=columns), k=40)
            code, details, data = status(rpc["Retrieve"], req.SerializeToString())
            assert code == grpc.StatusCode.OK, details
            got = [(i.item_id, i.score) for i in pb.RetrieveResponse.FromString(data).items]
            assert len(got) == 40 and not {i for i, _ in got} & sent
            same = pb.RetrieveRequest(user=user(long[-window:], CTX), k=40,
                                      exclude_items=sorted({h for h, _, _ in long[:-window]}))
            code, details, data = status(rpc["Retrieve"], same.SerializeToString())
            assert code == grpc.StatusCode.OK, details
            assert [(i.item_id, i.score) for i in pb.RetrieveResponse.FromString(data).items] == got
        short = user(events(5, seed=1), CTX)
        plain = [i.item_id for i in pb.RetrieveResponse.FromString(status(
            rpc["Retrieve"], pb.RetrieveRequest(user=short, k=30).SerializeToString())[2]).items]
        block = plain[::2]
        for method, req, resp in (
                ("Retrieve", pb.RetrieveRequest(user=short, k=30, exclude_items=block), pb.RetrieveResponse),
                ("Recommend", pb.RecommendRequest(user=short, retrieve_k=30, top_k=10, exclude_items=block,
                                                  exclude_history=False), pb.RecommendResponse)):
            code, details, data = status(rpc[method], req.SerializeToString())
            assert code == grpc.StatusCode.OK, details
            items = [i.item_id for i in resp.FromString(data).items]
            assert items and not set(items) & set(block), method
        ch.close()
    finally:
        srv.stop()


# ---- fuzz -----------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(rng: random.Random) -> bytes:
    """One field of a random number and wire type, with a payload that fits the type or not."""
    num, wire = rng.choice([rng.randint(1, 8), rng.randint(9, 2**29 - 1)]), rng.choice([0, 1, 2, 3, 4, 5, 6, 7])
    tag = _varint(num << 3 | wire)
    if wire == 0:
        return tag + rng.choice([_varint(rng.getrandbits(64)), b"\xff" * rng.randint(9, 12) + b"\x01", b"\x80"])
    if wire == 2:
        body = rng.randbytes(rng.randint(0, 40))
        return tag + _varint(rng.choice([len(body), len(body) + rng.randint(1, 5), rng.getrandbits(40)])) + body
    return tag + rng.randbytes(rng.choice([0, 4, 8]))


def _nested(depth: int, rng: random.Random) -> bytes:
    """A user whose history's first event is a message nested ``depth`` deep (fields 1 or
    unknown), or unknown groups nested that deep."""
    if rng.random() < 0.5:
        return b"\x0b" * depth + b"\x0c" * depth  # start group 1 ... end group 1
    body = b""
    for _ in range(depth):
        body = bytes([0x0A]) + _varint(len(body)) + body
    return b"\x0a" + _varint(len(body)) + body


def _seeds(rng: random.Random) -> list[tuple[str, bytes]]:
    u = user(events(rng.randint(1, 50), rng.randrange(99)), CTX, columns=rng.random() < 0.5)
    cands = [pb.Candidate(item_id=rng.randint(1, 600), bid=rng.random()) for _ in range(rng.randint(1, 12))]
    ex = [rng.randint(1, 600) for _ in range(rng.randint(0, 20))]
    return [("Recommend", pb.RecommendRequest(user=u, retrieve_k=20, top_k=5, exclude_items=ex).SerializeToString()),
            ("Recommend", pb.RecommendRequest(user=u, candidates=cands, objective="click").SerializeToString()),
            ("Retrieve", pb.RetrieveRequest(user=u, k=15, exclude_items=ex, exclude_history=False).SerializeToString()),
            ("Rank", pb.RankRequest(user=u, candidates=cands, objective="ecpm").SerializeToString())]


def fuzz_cases(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    out = []
    methods = ("Recommend", "Retrieve", "Rank")
    while len(out) < n:
        method, data = rng.choice(_seeds(rng))
        kind = rng.randrange(8)
        if kind == 0:  # truncated
            data = data[: rng.randint(0, len(data) - 1)]
        elif kind == 1:  # bit flips
            b = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            data = bytes(b)
        elif kind == 2:  # a field of any number and wire type inserted anywhere, huge varints included
            at = rng.randint(0, len(data))
            data = data[:at] + b"".join(_field(rng) for _ in range(rng.randint(1, 3))) + data[at:]
        elif kind == 3:  # deep nesting inside the user
            user_bytes = _nested(rng.choice([3, 30, 101, 1000, 20_000]), rng)
            data = data + b"\x0a" + _varint(len(user_bytes)) + user_bytes
        elif kind == 4:  # random bytes
            data = rng.randbytes(rng.choice([1, 7, 64, 999]))
        elif kind == 5:  # another call's request (a valid message of the wrong type), maybe spliced
            _, other = rng.choice(_seeds(rng))
            data = other if rng.random() < 0.5 else data[: rng.randrange(len(data))] + other
        elif kind == 6:  # a long string where a name or objective goes (any Unicode)
            text = "".join(chr(rng.choice([0x41, 0x25, 0x0A, 0xE9, 0x2603, 0x1F600])) for _ in range(rng.randint(9000, 20000)))
            if rng.random() < 0.5:
                extra = pb.RecommendRequest(user=pb.User(context=[pb.ContextFeature(name=text, ids=[1])]))
            else:
                extra = pb.RecommendRequest(objective=text)
            data = data + extra.SerializeToString()  # merged into the request
        else:  # a huge count: many values appended to a repeated field
            extra = pb.RecommendRequest(exclude_items=[rng.randint(1, 600)] * rng.choice([10, 5000, 50_000]))
            data = data + extra.SerializeToString()
        out.append((rng.choice(methods) if rng.random() < 0.1 else method, data))
    return out


def _excluded(method: str, data: bytes) -> set[int]:
    """The items a request that was served excludes from retrieval."""
    if method == "Rank":
        return set()
    req = (pb.RecommendRequest if method == "Recommend" else pb.RetrieveRequest).FromString(data)
    if method == "Recommend" and len(req.candidates):
        return set()
    u = req.user
    history = [e.item_id for e in u.history] or list(u.history_columns.item_ids)
    keep = req.HasField("exclude_history") and not req.exclude_history
    return set(req.exclude_items) | (set() if keep else set(history))


def test_fuzzed_requests_never_get_unknown_or_internal(artifact, engine):
    """1,500 seeded mutations of valid Recommend / Retrieve / Rank bytes (truncated, bit flips,
    fields of random numbers and wire types, huge varints, deep nesting, random bytes, the
    wrong message, long Unicode strings, huge counts) through a real server: each answer is OK
    or INVALID_ARGUMENT with a short ASCII detail (nothing for gRPC to percent-encode into a
    header over its limit), an answer never holds an item the request excluded, and the
    server stays up."""
    lim = Limits(max_history=64, max_candidates=32, max_exclude_items=1000)
    # (admission control off: the fuzz sends concurrently, and its refusals are not what this checks)
    srv = ThreadedServer(artifact, local_config(limits=lim,
                                               batch=BatchConfig(max_queue_ms=0)), engine=engine)
    try:
        ch, rpc = calls(srv.target)
        cases = fuzz_cases(random.Random(11), 1500)
        codes: dict[str, int] = {}
        bad = []
        t0 = time.monotonic()
        for start in range(0, len(cases), 16):  # a few in flight: batches, without overloading the queue
            futs = [(m, d, rpc[m].future(d, timeout=60)) for m, d in cases[start : start + 16]]
            for m, d, f in futs:
                try:
                    resp = getattr(pb, f"{m}Response").FromString(f.result())
                    code, details = grpc.StatusCode.OK, ""
                    if {i.item_id for i in resp.items} & _excluded(m, d):
                        bad.append((m, "an excluded item came back", d[:40]))
                except grpc.RpcError as e:
                    code, details = e.code(), e.details() or ""
                codes[code.name] = codes.get(code.name, 0) + 1
                if (code not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT) or len(details) > MAX_DETAIL
                        or not details.isascii()):
                    bad.append((m, code, details[:200], d[:40]))
        assert bad == [], (codes, bad[:5])
        assert codes.get("OK", 0) > 50 and codes.get("INVALID_ARGUMENT", 0) > 500, codes
        assert time.monotonic() - t0 < 120
        ok = pb.RecommendRequest(user=user(events(6), CTX), retrieve_k=10, top_k=5).SerializeToString()
        assert len(pb.RecommendResponse.FromString(rpc["Recommend"](ok, timeout=30)).items) == 5
        ch.close()
    finally:
        srv.stop()
