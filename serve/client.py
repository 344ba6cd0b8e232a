"""A small client for genrec.v1.Recommender (tests, demos, the load-test harness).

Several targets mean client-side round-robin over replicas:
``RecommenderClient(["127.0.0.1:50051", "127.0.0.1:50052"])`` opens one channel with
gRPC's ``round_robin`` policy over both, which is how stateless replicas scale out.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from proto.genrec.v1 import recommender_pb2 as pb
from proto.genrec.v1 import recommender_pb2_grpc as pb_grpc


def channel_for(targets: str | Sequence[str]) -> grpc.Channel:
    if isinstance(targets, str):
        targets = [targets]
    if len(targets) == 1:
        return grpc.insecure_channel(targets[0])
    addr = "ipv4:" + ",".join(targets)
    return grpc.insecure_channel(addr, options=[("grpc.lb_policy_name", "round_robin")])


def user(history: Sequence[int | tuple[int, int, int]], context: dict[str, Sequence[int]] | None = None,
         request_time: int = 0, columns: bool = False) -> pb.User:
    """history: item ids, or (item id, unix seconds, action bitmask) triples; ``columns``: sent
    as ``history_columns`` (packed arrays: smaller, and cheaper for the server to decode)."""
    ctx = [pb.ContextFeature(name=k, ids=list(v)) for k, v in (context or {}).items()]
    triples = [(h, 0, 0) if isinstance(h, int) else tuple(h) for h in history]
    if columns:
        items, times, actions = (list(c) for c in zip(*triples)) if triples else ([], [], [])
        cols = pb.EventColumns(item_ids=items, timestamps=times if any(times) else [],
                               actions=actions if any(actions) else [])
        return pb.User(history_columns=cols, context=ctx, request_time=request_time)
    events = [pb.Event(item_id=i, timestamp=t, actions=a) for i, t, a in triples]
    return pb.User(history=events, context=ctx, request_time=request_time)


class RecommenderClient:
    def __init__(self, targets: str | Sequence[str], timeout_s: float = 2.0) -> None:
        self.channel = channel_for(targets)
        self.stub = pb_grpc.RecommenderStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.timeout = timeout_s

    def recommend(self, u: pb.User, retrieve_k: int = 0, top_k: int = 0,
                  candidates: Sequence[tuple[int, float]] = (), objective: str = "") -> pb.RecommendResponse:
        req = pb.RecommendRequest(user=u, retrieve_k=retrieve_k, top_k=top_k, objective=objective,
                                  candidates=[pb.Candidate(item_id=i, bid=b) for i, b in candidates])
        return self.stub.Recommend(req, timeout=self.timeout)

    def retrieve(self, u: pb.User, k: int = 0) -> pb.RetrieveResponse:
        return self.stub.Retrieve(pb.RetrieveRequest(user=u, k=k), timeout=self.timeout)

    def rank(self, u: pb.User, candidates: Sequence[tuple[int, float]], objective: str = "") -> pb.RankResponse:
        req = pb.RankRequest(user=u, objective=objective, candidates=[pb.Candidate(item_id=i, bid=b) for i, b in candidates])
        return self.stub.Rank(req, timeout=self.timeout)

    def load_artifact(self, path: str) -> pb.LoadArtifactResponse:
        return self.admin.LoadArtifact(pb.LoadArtifactRequest(path=path), timeout=600)

    def info(self) -> pb.ModelInfo:
        return self.admin.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()
