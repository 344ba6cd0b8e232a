from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetrievalSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETRIEVAL_SOURCE_DENSE: _ClassVar[RetrievalSource]
    RETRIEVAL_SOURCE_GENERATIVE: _ClassVar[RetrievalSource]
    RETRIEVAL_SOURCE_BOTH: _ClassVar[RetrievalSource]
RETRIEVAL_SOURCE_DENSE: RetrievalSource
RETRIEVAL_SOURCE_GENERATIVE: RetrievalSource
RETRIEVAL_SOURCE_BOTH: RetrievalSource

class Event(_message.Message):
    __slots__ = ("item_id", "timestamp", "actions")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    item_id: int
    timestamp: int
    actions: int
    def __init__(self, item_id: _Optional[int] = ..., timestamp: _Optional[int] = ..., actions: _Optional[int] = ...) -> None: ...

class ContextFeature(_message.Message):
    __slots__ = ("name", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("item_id", "bid")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    BID_FIELD_NUMBER: _ClassVar[int]
    item_id: int
    bid: float
    def __init__(self, item_id: _Optional[int] = ..., bid: _Optional[float] = ...) -> None: ...

class EventColumns(_message.Message):
    __slots__ = ("item_ids", "timestamps", "actions")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    timestamps: _containers.RepeatedScalarFieldContainer[int]
    actions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, item_ids: _Optional[_Iterable[int]] = ..., timestamps: _Optional[_Iterable[int]] = ..., actions: _Optional[_Iterable[int]] = ...) -> None: ...

class User(_message.Message):
    __slots__ = ("history", "context", "request_time", "history_columns", "user_id")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    HISTORY_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    history: _containers.RepeatedCompositeFieldContainer[Event]
    context: _containers.RepeatedCompositeFieldContainer[ContextFeature]
    request_time: int
    history_columns: EventColumns
    user_id: str
    def __init__(self, history: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., context: _Optional[_Iterable[_Union[ContextFeature, _Mapping]]] = ..., request_time: _Optional[int] = ..., history_columns: _Optional[_Union[EventColumns, _Mapping]] = ..., user_id: _Optional[str] = ...) -> None: ...

class RecommendRequest(_message.Message):
    __slots__ = ("user", "retrieve_k", "top_k", "candidates", "exclude_history", "objective", "exclude_items", "source", "beam")
    USER_FIELD_NUMBER: _ClassVar[int]
    RETRIEVE_K_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    user: User
    retrieve_k: int
    top_k: int
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    exclude_history: bool
    objective: str
    exclude_items: _containers.RepeatedScalarFieldContainer[int]
    source: RetrievalSource
    beam: int
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ..., retrieve_k: _Optional[int] = ..., top_k: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., exclude_history: _Optional[bool] = ..., objective: _Optional[str] = ..., exclude_items: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[RetrievalSource, str]] = ..., beam: _Optional[int] = ...) -> None: ...

class ScoredItem(_message.Message):
    __slots__ = ("item_id", "score", "retrieval_score", "tasks", "generative_log_prob")
    class TasksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GENERATIVE_LOG_PROB_FIELD_NUMBER: _ClassVar[int]
    item_id: int
    score: float
    retrieval_score: float
    tasks: _containers.ScalarMap[str, float]
    generative_log_prob: float
    def __init__(self, item_id: _Optional[int] = ..., score: _Optional[float] = ..., retrieval_score: _Optional[float] = ..., tasks: _Optional[_Mapping[str, float]] = ..., generative_log_prob: _Optional[float] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "batch_size", "decode_ms", "wait_ms", "handoff_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    batch_size: int
    decode_ms: float
    wait_ms: float
    handoff_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., decode_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., handoff_ms: _Optional[float] = ...) -> None: ...

class RecommendResponse(_message.Message):
    __slots__ = ("items", "model_version", "timing")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoredItem]
    model_version: str
    timing: Timing
    def __init__(self, items: _Optional[_Iterable[_Union[ScoredItem, _Mapping]]] = ..., model_version: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class RetrieveRequest(_message.Message):
    __slots__ = ("user", "k", "exclude_history", "exclude_items", "source", "beam")
    USER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    user: User
    k: int
    exclude_history: bool
    exclude_items: _containers.RepeatedScalarFieldContainer[int]
    source: RetrievalSource
    beam: int
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ..., k: _Optional[int] = ..., exclude_history: _Optional[bool] = ..., exclude_items: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[RetrievalSource, str]] = ..., beam: _Optional[int] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("items", "model_version", "timing")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoredItem]
    model_version: str
    timing: Timing
    def __init__(self, items: _Optional[_Iterable[_Union[ScoredItem, _Mapping]]] = ..., model_version: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class RankRequest(_message.Message):
    __slots__ = ("user", "candidates", "objective")
    USER_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    user: User
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    objective: str
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., objective: _Optional[str] = ...) -> None: ...

class RankResponse(_message.Message):
    __slots__ = ("items", "model_version", "timing")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoredItem]
    model_version: str
    timing: Timing
    def __init__(self, items: _Optional[_Iterable[_Union[ScoredItem, _Mapping]]] = ..., model_version: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class LoadArtifactRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadArtifactResponse(_message.Message):
    __slots__ = ("model_version", "load_seconds")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    load_seconds: float
    def __init__(self, model_version: _Optional[str] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_version", "artifact_path", "tower", "tasks", "actions", "context_features", "catalogue_size", "max_history", "engine", "embeddings", "dense", "generative", "semantic_id_sizes", "default_beam", "max_beam", "replicas", "dense_search")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_PATH_FIELD_NUMBER: _ClassVar[int]
    TOWER_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CATALOGUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    GENERATIVE_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_ID_SIZES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BEAM_FIELD_NUMBER: _ClassVar[int]
    MAX_BEAM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DENSE_SEARCH_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    artifact_path: str
    tower: str
    tasks: _containers.RepeatedScalarFieldContainer[str]
    actions: _containers.RepeatedScalarFieldContainer[str]
    context_features: _containers.RepeatedScalarFieldContainer[str]
    catalogue_size: int
    max_history: int
    engine: str
    embeddings: str
    dense: str
    generative: bool
    semantic_id_sizes: _containers.RepeatedScalarFieldContainer[int]
    default_beam: int
    max_beam: int
    replicas: _containers.RepeatedCompositeFieldContainer[EngineReplica]
    dense_search: str
    def __init__(self, model_version: _Optional[str] = ..., artifact_path: _Optional[str] = ..., tower: _Optional[str] = ..., tasks: _Optional[_Iterable[str]] = ..., actions: _Optional[_Iterable[str]] = ..., context_features: _Optional[_Iterable[str]] = ..., catalogue_size: _Optional[int] = ..., max_history: _Optional[int] = ..., engine: _Optional[str] = ..., embeddings: _Optional[str] = ..., dense: _Optional[str] = ..., generative: _Optional[bool] = ..., semantic_id_sizes: _Optional[_Iterable[int]] = ..., default_beam: _Optional[int] = ..., max_beam: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[EngineReplica, _Mapping]]] = ..., dense_search: _Optional[str] = ...) -> None: ...

class EngineReplica(_message.Message):
    __slots__ = ("role", "state", "model_version", "pid", "detail")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    role: str
    state: str
    model_version: str
    pid: int
    detail: str
    def __init__(self, role: _Optional[str] = ..., state: _Optional[str] = ..., model_version: _Optional[str] = ..., pid: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
