"""The public API's request boundary: every repeated field bounded before the work it causes,
and error details bounded."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest

import serve.requests as requests
from proto.genrec.v1 import recommender_pb2 as pb
from serve.client import user
from serve.engine import TorchEngine
from serve.requests import MAX_DETAIL, InvalidRequest, Limits, decode
from serve.server import ServeConfig
from tests.serving_helpers import ThreadedServer, tiny_ranking_artifact

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
    srv = ThreadedServer(engine.artifact, ServeConfig(host="127.0.0.1", port=0), engine=engine)
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
    lim = Limits(max_history=40, max_candidates=8, max_context_features=2, max_context_ids=5)
    ok, many = events(40), events(41)
    cands = [pb.Candidate(item_id=i, bid=1.0) for i in range(1, 10)]
    over = {  # field named -> (kind, request): the rest of each request is valid and large
        "user.history": ("retrieve", pb.RetrieveRequest(user=user(many, CTX))),
        "user.history_columns.item_ids": ("retrieve", pb.RetrieveRequest(user=user(many, CTX, columns=True))),
        "user.history_columns.timestamps": ("retrieve", pb.RetrieveRequest(user=pb.User(
            history_columns=pb.EventColumns(item_ids=[1] * 40, timestamps=[T0] * 41)))),
        "user.context": ("recommend", pb.RecommendRequest(user=pb.User(
            history=user(ok).history, context=[pb.ContextFeature(name="region", ids=[1])] * 3))),
        "user.context[1].ids": ("recommend", pb.RecommendRequest(user=pb.User(
            history=user(ok).history, context=[pb.ContextFeature(name="region", ids=[1]),
                                               pb.ContextFeature(name="region", ids=list(range(6)))]))),
        "candidates": ("rank", pb.RankRequest(user=user(ok, CTX), candidates=cands)),
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
                             candidates=cands[:8])
    work = decode("recommend", at.SerializeToString(), engine.schema, lim)
    assert work.candidates.size == 8 and counter.n > 0


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


def test_the_largest_request_the_limits_allow_is_within_their_byte_bound():
    """request_bytes() must not refuse a request its counts allow: every element at its longest
    encoding (ids near 2^63, unpacked columns, 256-character names)."""
    lim = Limits(max_history=30, max_candidates=7, max_context_features=3, max_context_ids=11)
    big, name = 2**63 - 1, "n" * 256
    ctx = [pb.ContextFeature(name=name, ids=[big] * lim.max_context_ids)] * lim.max_context_features
    hist = [pb.Event(item_id=big, timestamp=big, actions=2**32 - 1)] * lim.max_history
    cands = [pb.Candidate(item_id=big, bid=1e300)] * lim.max_candidates
    reqs = [pb.RecommendRequest(user=pb.User(history=hist, context=ctx, request_time=big), retrieve_k=2**32 - 1,
                                top_k=2**32 - 1, candidates=cands, exclude_history=False, objective=name),
            pb.RetrieveRequest(user=pb.User(history_columns=pb.EventColumns(
                item_ids=[big] * lim.max_history, timestamps=[big] * lim.max_history,
                actions=[2**32 - 1] * lim.max_history), context=ctx, request_time=big), k=2**32 - 1,
                exclude_history=True)]
    for req in reqs:
        data = req.SerializeToString()
        # sent unpacked (valid too), each value of a repeated scalar takes one tag byte more
        n_scalars = lim.max_history * 3 + lim.max_context_features * lim.max_context_ids
        assert len(data) + n_scalars <= lim.request_bytes(), (len(data), lim.request_bytes())
        requests._size(data, lim)  # not refused on its size
