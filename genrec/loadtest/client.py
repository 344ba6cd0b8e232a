"""A small client for genrec.v1.Recommender (tests, demos, the load-test harness).

Several targets mean client-side round-robin over replicas:
``RecommenderClient(["127.0.0.1:50051", "127.0.0.1:50052"])`` opens one channel with
gRPC's ``round_robin`` policy over both, which is how stateless replicas scale out.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from genrec.proto.v1 import recommender_pb2 as pb
from genrec.proto.v1 import recommender_pb2_grpc as pb_grpc


def channel_for(targets: str | Sequence[str], credentials: grpc.ChannelCredentials | None = None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to one target or, round-robin, several; TLS when ``credentials`` are given
    (``grpc.ssl_channel_credentials(root_certificates=...)``)."""
    if isinstance(targets, str):
        targets = [targets]
    opts = list(options)
    if len(targets) == 1:
        addr = targets[0]
    else:
        addr = "ipv4:" + ",".join(targets)
        opts.append(("grpc.lb_policy_name", "round_robin"))
    return grpc.secure_channel(addr, credentials, opts) if credentials else grpc.insecure_channel(addr, opts)


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
    """Recommender calls on ``targets``; Admin calls on ``admin_target`` (the server's own Admin
    listener) with ``admin_token`` as its bearer token. ``tenant``: the caller's name, sent as
    ``tenant`` metadata on every call (the server's fair shares, serve.admission)."""

    def __init__(self, targets: str | Sequence[str], timeout_s: float = 2.0, admin_target: str | None = None,
                 admin_token: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 tenant: str = "") -> None:
        self.channel = channel_for(targets, credentials)
        self.stub = pb_grpc.RecommenderStub(self.channel)
        self.admin_channel = channel_for(admin_target, credentials) if admin_target else None
        self.admin = pb_grpc.AdminStub(self.admin_channel) if self.admin_channel else None
        self.admin_metadata = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
        self.timeout = timeout_s
        self.metadata = (("tenant", tenant),) if tenant else ()

    def recommend(self, u: pb.User, retrieve_k: int = 0, top_k: int = 0,
                  candidates: Sequence[tuple[int, float]] = (), objective: str = "",
                  exclude_items: Sequence[int] = (), source: int = pb.RETRIEVAL_SOURCE_DENSE,
                  beam: int = 0) -> pb.RecommendResponse:
        """``exclude_items``: never retrieved (besides the history), e.g. what the caller
        already showed or what its truncated history no longer carries. ``source``: a
        ``pb.RetrievalSource`` (dense, generative or both); ``beam``: the decoder's beam (0: the
        model's default)."""
        req = pb.RecommendRequest(user=u, retrieve_k=retrieve_k, top_k=top_k, objective=objective,
                                  candidates=[pb.Candidate(item_id=i, bid=b) for i, b in candidates],
                                  exclude_items=list(exclude_items), source=source, beam=beam)
        return self.stub.Recommend(req, timeout=self.timeout, metadata=self.metadata)

    def retrieve(self, u: pb.User, k: int = 0, exclude_items: Sequence[int] = (),
                 source: int = pb.RETRIEVAL_SOURCE_DENSE, beam: int = 0) -> pb.RetrieveResponse:
        req = pb.RetrieveRequest(user=u, k=k, exclude_items=list(exclude_items), source=source, beam=beam)
        return self.stub.Retrieve(req, timeout=self.timeout, metadata=self.metadata)

    def rank(self, u: pb.User, candidates: Sequence[tuple[int, float]], objective: str = "") -> pb.RankResponse:
        req = pb.RankRequest(user=u, objective=objective, candidates=[pb.Candidate(item_id=i, bid=b) for i, b in candidates])
        return self.stub.Rank(req, timeout=self.timeout, metadata=self.metadata)

    def _admin_stub(self) -> pb_grpc.AdminStub:
        if self.admin is None:
            raise ValueError("no admin_target: Admin is served on its own listener (serve.admin.port)")
        return self.admin

    def load_artifact(self, path: str) -> pb.LoadArtifactResponse:
        return self._admin_stub().LoadArtifact(pb.LoadArtifactRequest(path=path), timeout=600,
                                               metadata=self.admin_metadata)

    def info(self) -> pb.ModelInfo:
        return self._admin_stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                               metadata=self.admin_metadata)

    def close(self) -> None:
        self.channel.close()
        if self.admin_channel:
            self.admin_channel.close()
