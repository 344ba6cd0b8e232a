"""Request decoding and validation: wire bytes -> typed work items, or INVALID_ARGUMENT.

Everything a request can get wrong is checked here, at the boundary, and named by its
field path (``user.history[3].item_id``) so the caller can fix it; past this module the
engines trust their inputs. Rules:

* the request is at most ``Limits.request_bytes()`` long (checked before it is parsed), it
  parses (a truncated or foreign payload is invalid, not an internal error) and carries no
  field this contract does not define, at any depth;
* history: 1..``max_history`` events; ids fit the item table (or hash, if the table says
  so); action bitmasks fit the model's actions; timestamps >= 0. A history longer than the
  model's window (``ModelSchema.max_history``) is accepted: the model reads its latest
  events, ``exclude_history`` drops every item of it from retrieval;
* context: at most ``max_context_features`` known feature names, each at most once, each
  with at most ``max_context_ids`` ids that fit their tables;
* candidates: at most ``max_candidates``, valid ids, bids finite and >= 0;
* exclude_items: at most ``max_exclude_items`` ids, valid as candidates' are; an id of the
  table that is not in the catalogue excludes nothing;
* sizes: ``retrieve_k`` / ``k`` up to ``max_retrieve`` and the catalogue; ``top_k`` up to
  what is ranked; objective: "", "retrieval", "ecpm" or a task name;
* source: a ``RetrievalSource`` value; GENERATIVE / BOTH need a model with a semantic-ID
  decoder (else :class:`ModelCannot`, FAILED_PRECONDITION: the request is well formed, the
  served artifact cannot answer it); ``beam`` up to ``max_beam`` (0: the model's default).

Every repeated field's count is checked before its elements are converted, and an error
quotes at most ``MAX_QUOTE`` characters of a request's string and is at most
``MAX_DETAIL`` characters in all (a gRPC status detail travels in a header).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from genrec.embedding.spec import EmbeddingConfig, IdOutOfRange, prepare_ids
from genrec.models.inputs import history_window  # noqa: F401 - the engines cut histories with it
from genrec.proto.v1 import recommender_pb2 as pb

Kind = Literal["recommend", "retrieve", "rank"]
Source = Literal["dense", "generative", "both"]
SOURCES: dict[int, Source] = {pb.RETRIEVAL_SOURCE_DENSE: "dense", pb.RETRIEVAL_SOURCE_GENERATIVE: "generative",
                              pb.RETRIEVAL_SOURCE_BOTH: "both"}
DEFAULT_RETRIEVE_K, DEFAULT_TOP_K = 100, 10


MAX_QUOTE = 64  # characters of a request's string an error message repeats
MAX_DETAIL = 512  # characters of an error message in all (as serve.server bounds a status detail)


def quote(text: str) -> str:
    """A request's string for an error message: quoted, escaped to printable ASCII (as
    ``ascii()`` does), at most ``MAX_QUOTE`` characters of that, then ``...`` where cut."""
    shown = ascii(text[: MAX_QUOTE + 1])[1:-1]
    return f"'{shown[:MAX_QUOTE]}'" + ("..." if len(shown) > MAX_QUOTE else "")


class InvalidRequest(ValueError):
    """A request breaks the contract; ``str()`` names the field: ASCII, at most ``MAX_DETAIL``
    characters (what is past that is cut, ``...`` marks the cut). ``status``: the gRPC status
    code's name the server answers it with."""

    status = "INVALID_ARGUMENT"

    def __init__(self, message: str) -> None:
        message = message[: MAX_DETAIL + 1].encode("ascii", "backslashreplace").decode("ascii")
        if len(message) > MAX_DETAIL:
            message = message[: MAX_DETAIL - 3] + "..."
        super().__init__(message)


class ModelCannot(InvalidRequest):
    """A well-formed request the served model cannot answer (generative retrieval from a model
    without a semantic-ID decoder): FAILED_PRECONDITION, not INVALID_ARGUMENT, since the same
    request succeeds once an artifact with a decoder is loaded."""

    status = "FAILED_PRECONDITION"


# The most bytes one element of a repeated field takes on the wire, counted for elements
# sent unpacked (a tag per value): decode() refuses a request longer than the largest one
# its limits allow before parsing it, so parsing costs at most what the limits allow.
_EVENT_BYTES = 2 + 3 * 11  # Event in User.history: tag + length, three tagged varints
_ID_BYTES = 11  # a tagged int64 (EventColumns, ContextFeature.ids, exclude_items)
_CANDIDATE_BYTES = 3 + 11 + 9  # tag + length, item_id, bid
_NAME_BYTES = 256  # a context feature's name or an objective, counted at this length at most
_FIXED_BYTES = 1024  # the scalars and the nested messages' headers
MAX_USER_ID_BYTES = 128  # User.user_id (counted in the fixed bytes above)


@dataclass(frozen=True)
class Limits:
    """How much one request may ask for; every count is checked before the work it causes.

    A history may be longer than the model's window (the model reads its latest events;
    ``exclude_history`` drops all of it from retrieval), up to ``max_history``."""

    max_history: int = 16384  # events in User.history or history_columns (ads users: 10^4)
    max_candidates: int = 2048  # candidates of Recommend / Rank
    max_retrieve: int = 1024  # retrieve_k / k
    max_exclude_items: int = 4096  # exclude_items of Recommend / Retrieve
    max_context_features: int = 32  # entries of User.context
    max_context_ids: int = 256  # ids of one context feature
    max_beam: int = 256  # beam of generative retrieval (its work: beam x levels decoder rows per user)
    max_request_bytes: int = 0  # a request's size; 0: the largest the limits above allow
    # the longest deadline honoured (ms): a call asking more is served as if it asked this, so
    # a 300 s deadline on the largest shape cannot hold a queue slot or an engine for 300 s
    max_deadline_ms: float = 10_000.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            least = 0 if name == "max_request_bytes" else 1  # 0 bytes: derived from the others
            if value < least:
                raise ValueError(f"serve limits: {name} = {value}; it must be at least {least}")

    def request_bytes(self) -> int:
        """The longest request decode() parses: ``max_request_bytes``, or where that is 0 the
        largest request the other limits allow (every element at its longest encoding)."""
        if self.max_request_bytes:
            return self.max_request_bytes
        context = self.max_context_features * (6 + _NAME_BYTES + self.max_context_ids * _ID_BYTES)
        return (_FIXED_BYTES + MAX_USER_ID_BYTES + 2 * _NAME_BYTES + self.max_history * _EVENT_BYTES + context
                + self.max_candidates * _CANDIDATE_BYTES + self.max_exclude_items * _ID_BYTES)


@dataclass
class UserInput:
    items: np.ndarray  # [n] item table rows
    times: np.ndarray  # [n] unix seconds (0 where unknown)
    actions: np.ndarray  # [n] action bitmasks
    has_time: bool
    request_time: int
    context: dict[str, np.ndarray] = field(default_factory=dict)
    user_id: str = ""  # the key engines cache its encoded history under ("": not cached)


@dataclass
class Work:
    kind: Kind
    user: UserInput
    retrieve_k: int = 0
    top_k: int = 0
    candidates: np.ndarray | None = None  # [c] item table rows
    candidate_ids: np.ndarray | None = None  # [c] as the caller sent them
    bids: np.ndarray | None = None  # [c]
    exclude_history: bool = True
    exclude_items: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [e] item table rows
    objective: str = ""
    source: Source = "dense"  # where retrieval finds candidates (RetrievalSource)
    beam: int = 0  # generative retrieval's beam width (set by decode: the request's or the model's default)
    deadline: float = math.inf  # time.monotonic() by which the caller stops waiting
    enqueued: float = field(default_factory=time.monotonic)

    def excluded(self) -> np.ndarray | None:
        """[e] item table rows retrieval must not return: ``exclude_items``, and with
        ``exclude_history`` every item of the history sent (not only the model's window);
        None when there are none. Every engine's retrieval masks these (an id outside the
        catalogue masks nothing)."""
        if self.exclude_history and self.exclude_items.size:
            return np.concatenate([self.user.items, self.exclude_items])
        if self.exclude_history:
            return self.user.items
        return self.exclude_items if self.exclude_items.size else None


@dataclass(frozen=True)
class ModelSchema:
    """What a served model accepts, read from its artifact."""

    embedding: EmbeddingConfig
    num_actions: int
    tasks: tuple[str, ...]
    catalogue_size: int
    max_history: int  # events the tower can take
    beam_width: int = 0  # the semantic-ID decoder's default beam; 0: the model has no decoder
    sid_sizes: tuple[int, ...] = ()  # codes per level of its semantic IDs
    dense_search: str = "exact"  # which search answers dense retrieval ("exact", or "ann <factory> ...")

    @property
    def generative(self) -> bool:
        return self.beam_width > 0


def _unknown_fields(msg: Message, path: str) -> str | None:
    if len(UnknownFieldSet(msg)):
        return path or "request"
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        single = isinstance(value, Message)
        for i, sub in enumerate([value] if single else value):
            where = f"{path}.{fd.name}" if path else fd.name
            bad = _unknown_fields(sub, where if single else f"{where}[{i}]")
            if bad:
                return bad
    return None


def parse(cls: type[Message], data: bytes) -> Message:
    try:
        msg = cls.FromString(data)
    except DecodeError as e:
        raise InvalidRequest(f"request: cannot parse {cls.DESCRIPTOR.name} ({e}); truncated or not protobuf") from None
    # Fast check first: a parsed message keeps its unknown fields and counts them in its size,
    # so the size changes when they are dropped exactly when there were some. (Not the size of
    # the bytes received: an unpacked repeated field re-encodes packed, longer, which can hide as
    # many bytes of unknown fields.) Otherwise walk the message to name the field (a walk of
    # every event, as costly as a good part of the decoding itself, hence not on every call).
    size = msg.ByteSize()
    msg.DiscardUnknownFields()
    if msg.ByteSize() == size:
        return msg
    msg = cls.FromString(data)
    bad = _unknown_fields(msg, "")
    if bad:
        raise InvalidRequest(f"{bad}: has fields this contract (genrec.v1) does not define")
    return msg


def _ids(schema: ModelSchema, feature: str, ids: np.ndarray, field_path: str) -> np.ndarray:
    try:
        return prepare_ids(schema.embedding.table_of(feature), feature, ids)
    except IdOutOfRange as e:
        idx = int(np.flatnonzero(ids == e.value)[0])
        raise InvalidRequest(f"{field_path.format(idx)}: {e}") from None


_COLUMN = {"item_id": "item_ids", "timestamp": "timestamps", "actions": "actions"}


def _history(user: pb.User) -> tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[object, str], str]]:
    """(item ids, timestamps, actions) [n] int64 of ``user.history`` or ``user.history_columns``,
    and how an error names event i's field (``where(i, "item_id" | "timestamp" | "actions")``)."""
    columns = user.HasField("history_columns")
    if columns and len(user.history):
        raise InvalidRequest("user: sets both history and history_columns; send the history once")
    cols = user.history_columns
    if columns:
        n, name = len(cols.item_ids), "user.history_columns.item_ids"
        where = lambda i, field: f"user.history_columns.{_COLUMN[field]}[{i}]"  # noqa: E731
    else:
        n, name = len(user.history), "user.history"
        where = lambda i, field: f"user.history[{i}].{field}"  # noqa: E731
    if n == 0:
        raise InvalidRequest(f"{name}: is empty; send at least one past event")
    if not columns:
        h = user.history
        return (np.fromiter((e.item_id for e in h), np.int64, n), np.fromiter((e.timestamp for e in h), np.int64, n),
                np.fromiter((e.actions for e in h), np.int64, n), where)
    for col in ("timestamps", "actions"):  # both checked before any column is converted
        if len(getattr(cols, col)) not in (0, n):
            raise InvalidRequest(f"user.history_columns.{col}: has {len(getattr(cols, col))} values for {n} "
                                 "item_ids; send one per item or none")
    items = np.fromiter(cols.item_ids, np.int64, n)
    times, actions = (np.fromiter(v, np.int64, n) if len(v) else np.zeros(n, np.int64)
                      for v in (cols.timestamps, cols.actions))
    return items, times, actions, where


def _context(user: pb.User, schema: ModelSchema) -> dict[str, np.ndarray]:
    """{feature: table ids} of ``user.context`` (its counts checked by :func:`_user_counts`)."""
    known = schema.embedding.pooled_features
    context: dict[str, np.ndarray] = {}
    for i, f in enumerate(user.context):
        if f.name not in known:
            raise InvalidRequest(f"user.context[{i}].name: {quote(f.name)} is not a context feature of this model; "
                                 f"known: {list(known)}")
        if f.name in context:
            raise InvalidRequest(f"user.context[{i}].name: {quote(f.name)} is given twice")
        ids = np.fromiter(f.ids, np.int64, len(f.ids))
        context[f.name] = _ids(schema, f.name, ids, f"user.context[{i}].ids[{{}}]")
    return context


def decode_user(user: pb.User, schema: ModelSchema, limits: Limits) -> UserInput:
    """``user`` -> its validated history (all of it, up to ``limits.max_history``: the engines
    give the model its latest ``schema.max_history`` events) and context."""
    _user_counts(user, limits)
    raw, times, actions, where = _history(user)
    items = _ids(schema, schema.embedding.item_feature, raw, where("{}", "item_id"))
    if (times < 0).any():
        raise InvalidRequest(f"{where(int(np.flatnonzero(times < 0)[0]), 'timestamp')}: is negative")
    if (actions >= (1 << schema.num_actions)).any():
        i = int(np.flatnonzero(actions >= (1 << schema.num_actions))[0])
        raise InvalidRequest(f"{where(i, 'actions')}: bitmask {actions[i]} has bits beyond the model's "
                             f"{schema.num_actions} actions")
    if user.request_time < 0:
        raise InvalidRequest("user.request_time: is negative")
    # as for a request of the model's window alone (what the engines give it)
    has_time = bool((times[-schema.max_history :] > 0).all())
    request_time = user.request_time or (int(times[-1]) if has_time else 0)
    if len(user.user_id.encode()) > MAX_USER_ID_BYTES:
        raise InvalidRequest(f"user.user_id: is longer than {MAX_USER_ID_BYTES} bytes")
    return UserInput(items, times, actions, has_time, request_time, _context(user, schema), user.user_id)


def _candidates(cands, schema: ModelSchema) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # noqa: ANN001
    c = len(cands)
    raw = np.fromiter((x.item_id for x in cands), np.int64, c)
    rows = _ids(schema, schema.embedding.item_feature, raw, "candidates[{}].item_id")
    bids = np.fromiter((x.bid for x in cands), np.float64, c)
    bad = ~np.isfinite(bids) | (bids < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidRequest(f"candidates[{i}].bid: {bids[i]} is not a finite number >= 0")
    return rows, raw, bids


def _exclude(ids, schema: ModelSchema) -> np.ndarray:  # noqa: ANN001
    """``exclude_items`` -> item table rows. Ids are checked as candidates' are (one outside
    the item table is INVALID_ARGUMENT, or hashed where the table hashes, as a history's item
    is): a bad id is a caller's bug, better named than silently excluding nothing. An id of the
    table that is not in the catalogue (e.g. a retired item) is fine: it excludes nothing."""
    n = len(ids)
    return _ids(schema, schema.embedding.item_feature, np.fromiter(ids, np.int64, n), "exclude_items[{}]")


def _over(path: str, n: int, limit: int, what: str) -> None:
    if n > limit:
        raise InvalidRequest(f"{path}: has {n} {what}; the limit is {limit}")


def _user_counts(user: pb.User, limits: Limits) -> None:
    """The counts of ``user``'s repeated fields against ``limits``, before any is converted."""
    cols = user.history_columns
    _over("user.history", len(user.history), limits.max_history, "events")
    for col in ("item_ids", "timestamps", "actions"):
        _over(f"user.history_columns.{col}", len(getattr(cols, col)), limits.max_history, "values")
    _over("user.context", len(user.context), limits.max_context_features, "features")
    for i, f in enumerate(user.context):
        _over(f"user.context[{i}].ids", len(f.ids), limits.max_context_ids, "ids")


def _counts(req: Message, limits: Limits) -> None:
    """Every repeated field's count against its limit, before any element is converted."""
    _user_counts(req.user, limits)
    if hasattr(req, "candidates"):
        _over("candidates", len(req.candidates), limits.max_candidates, "candidates")
    if hasattr(req, "exclude_items"):
        _over("exclude_items", len(req.exclude_items), limits.max_exclude_items, "ids")


def _size(data: bytes, limits: Limits) -> None:
    """Refuses a request longer than the limits allow before it is parsed: parsing costs in
    proportion to the bytes, and the gRPC listener's own cap is megabytes."""
    if len(data) > limits.request_bytes():
        raise InvalidRequest(f"request: {len(data)} bytes, more than the {limits.request_bytes()} the server's "
                             "limits allow (max_history, max_candidates, ...); send fewer events or ids")


def _objective(name: str, schema: ModelSchema, path: str) -> str:
    valid = ["", "retrieval", *schema.tasks] + (["ecpm"] if schema.tasks else [])
    if name not in valid:
        raise InvalidRequest(f"{path}: {quote(name)} is not an objective of this model; valid: {valid}")
    return name


def _k(value: int, default: int, upper: int, path: str) -> int:
    k = value or default
    if k > upper:
        raise InvalidRequest(f"{path}: {k} is more than the limit {upper}")
    return k


def _source(req: Message, schema: ModelSchema, limits: Limits, retrieves: bool) -> tuple[Source, int]:
    """(source, beam) of a Recommend / Retrieve request. An unknown source value or a beam over
    the limit is refused even where nothing is retrieved (a caller's bug, better named); the
    decoder is needed only where the request retrieves."""
    source = SOURCES.get(req.source)
    if source is None:
        valid = ", ".join(f"{pb.RetrievalSource.Name(v)} ({v})" for v in SOURCES)
        raise InvalidRequest(f"source: {req.source} is not a RetrievalSource; valid: {valid}")
    if req.beam > limits.max_beam:
        raise InvalidRequest(f"beam: {req.beam} is more than the limit {limits.max_beam}")
    if source != "dense" and retrieves and not schema.generative:
        raise ModelCannot(f"source: {pb.RetrievalSource.Name(req.source)} needs a model with a semantic-ID "
                          "decoder; this artifact has none (ModelInfo.generative); use RETRIEVAL_SOURCE_DENSE")
    # 0: the model's beam, within the server's limit (the operator's two choices)
    return source, (req.beam or min(schema.beam_width, limits.max_beam)) if schema.generative else 0


def decode(kind: Kind, data: bytes, schema: ModelSchema, limits: Limits) -> Work:
    """Bytes of a Recommend / Retrieve / Rank request -> a validated ``Work``."""
    _size(data, limits)
    if kind == "recommend":
        req = parse(pb.RecommendRequest, data)
        _counts(req, limits)
        user = decode_user(req.user, schema, limits)
        cap = min(limits.max_retrieve, schema.catalogue_size)
        work = Work(kind, user, objective=_objective(req.objective, schema, "objective"),
                    exclude_history=req.exclude_history if req.HasField("exclude_history") else True,
                    exclude_items=_exclude(req.exclude_items, schema))
        if len(req.candidates):
            work.candidates, work.candidate_ids, work.bids = _candidates(req.candidates, schema)
            pool = len(req.candidates)
        else:
            work.retrieve_k = _k(req.retrieve_k, min(DEFAULT_RETRIEVE_K, cap), cap, "retrieve_k")
            pool = work.retrieve_k
        work.source, work.beam = _source(req, schema, limits, retrieves=not len(req.candidates))
        work.top_k = _k(req.top_k, min(DEFAULT_TOP_K, pool), pool, "top_k")
        return work
    if kind == "retrieve":
        req = parse(pb.RetrieveRequest, data)
        _counts(req, limits)
        cap = min(limits.max_retrieve, schema.catalogue_size)
        source, beam = _source(req, schema, limits, retrieves=True)
        return Work(kind, decode_user(req.user, schema, limits), retrieve_k=_k(req.k, min(DEFAULT_RETRIEVE_K, cap), cap, "k"),
                    exclude_history=req.exclude_history if req.HasField("exclude_history") else True,
                    exclude_items=_exclude(req.exclude_items, schema), source=source, beam=beam)
    req = parse(pb.RankRequest, data)
    _counts(req, limits)
    if not schema.tasks:
        raise InvalidRequest("Rank: this model has no ranking tasks; use Retrieve or Recommend")
    if len(req.candidates) == 0:
        raise InvalidRequest("candidates: is empty; Rank needs at least one")
    work = Work(kind, decode_user(req.user, schema, limits), objective=_objective(req.objective, schema, "objective"))
    work.candidates, work.candidate_ids, work.bids = _candidates(req.candidates, schema)
    work.top_k = len(req.candidates)
    return work
