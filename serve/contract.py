"""The engine contract: what the server and the batcher call on an engine, and what it returns.

An engine takes a batch of validated ``Work`` (serve.requests) and returns one :class:`Result`
each, in order. Every engine, and every wrapper that stands in for one, implements
:class:`Engine`::

    TorchEngine                     serve.engine: the model in this process (InProcessEngine)
    SGLangEngine                    serve.sglang_engine: the model in SGLang's scheduler (InProcessEngine)
    EngineProcess                   serve.worker: an engine in a child process
    FailoverEngine                  serve.failover: an engine process and a warm standby
    EnginePool                      serve.failover: replicas; a batch runs on a free one

mypy holds each to the protocol where the server and the factories hand them out as ``Engine``;
tests/test_engine_contract.py runs one suite over all of them. Nobody probes an engine with
``hasattr``: what the batcher must know (``batches_together``, ``parallel``) and what the
server must follow (``available``, ``on_state``) is part of the contract.

This module imports no torch: the front-end of an engine process reads it before any model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from genrec.quant.artifact import Manifest
    from genrec.serve.ann import RetrievalConfig
    from genrec.serve.kvcache import CacheConfig
    from genrec.serve.requests import ModelSchema, Work
    from genrec.serve.scoring import ScoringConfig


class WorkFailed(RuntimeError):
    """One work the engine could not compute while it went on serving (a fault in the model's
    forward for that request): its call fails INTERNAL with this message, which names the
    cause (serve.server); the other works of its batch are answered."""


class PartlyFailed(RuntimeError):
    """Raised by ``run`` when some works of the batch failed and the rest were computed:
    ``outcomes`` holds, per work in order, its :class:`Result` or its :class:`WorkFailed`. The
    batcher answers each call with its own (a direct caller of ``run`` sees the batch fail)."""

    def __init__(self, outcomes: list[Result | WorkFailed]) -> None:
        failed = [o for o in outcomes if isinstance(o, WorkFailed)]
        super().__init__(f"{len(failed)} of {len(outcomes)} works failed: {failed[0] if failed else ''}")
        self.outcomes = outcomes

    def __reduce__(self):  # noqa: ANN204 - (pickled across an engine process's pipe: by its outcomes)
        return type(self), (self.outcomes,)


@dataclass
class Result:
    """One work's answer. Shapes: k items (``top_k`` for a Recommend, ``retrieve_k`` at most for a
    Retrieve, the candidates for a Rank), in final order."""

    item_ids: np.ndarray  # [k] in final order
    scores: np.ndarray  # [k] the ordering value
    retrieval_scores: np.ndarray | None = None  # [k] dense logits (NaN: not retrieved by the dense source)
    tasks: dict[str, np.ndarray] = field(default_factory=dict)  # task -> [k]
    compute_ms: float = 0.0
    batch_size: int = 1
    # time.monotonic() when the batcher handed the batch to the engine, when the engine began it
    # (the same clock in an engine process: system-wide; 0: not stamped) and when the results came back
    sent: float = 0.0
    started: float = 0.0
    back: float = 0.0
    # the per-user K/V cache (serve.kvcache): the request's history tokens (its window), those
    # reused from the cache, those of other users evicted to keep its own, and whether it was
    # looked up (a user_id, the cache on); ``cache_gauges``: the cache after its batch (KVCache.gauges)
    history_tokens: int = 0
    cached_tokens: int = 0
    evicted_tokens: int = 0
    cache_lookup: bool = False
    cache_gauges: dict[str, int] | None = None
    prefilled_tokens: int = 0  # history tokens the tower computed for it (SGLang: in the pass that ended it)
    generative_scores: np.ndarray | None = None  # [k] decoder log-probabilities (NaN: not generated)


@dataclass(frozen=True)
class ReplicaState:
    """One engine process of a served engine (or the in-process engine itself), as
    Admin.GetModelInfo reports it: ``role`` (in-process, serving, standby, replica),
    ``state`` (ready, loading, dead, refused, closed), ``version``: the model it holds
    ("" while it holds none; for ``refused``, the one it found and would not serve),
    ``pid`` (0: this process, or none), ``detail``: why it is not ready."""

    role: str
    state: str
    version: str
    pid: int = 0
    detail: str = ""


@runtime_checkable
class Engine(Protocol):
    """A served model: ``run(works)`` -> one Result per work. Read-only members may be plain
    attributes or properties."""

    @property
    def name(self) -> str:
        """The engine kind (``ServeConfig.engine``: torch, sglang; the benchmarks' naive): a reload builds the same."""

    @property
    def version(self) -> str:
        """The artifact's version (run / checkpoint / quantization @ a hash of its content:
        ``serve.catalogue.version_of``), sent with every answer."""

    @property
    def schema(self) -> ModelSchema:
        """What the served model accepts (requests are decoded against it)."""

    @property
    def manifest(self) -> Manifest:
        """The served artifact's manifest."""

    @property
    def tower(self) -> str:
        """The model's tower (hstu, transformer)."""

    @property
    def path(self) -> str | None:
        """How the engine runs the tower (torch: native, packed or jagged; None: not said)."""

    @property
    def stages(self) -> dict[str, float]:
        """Seconds spent per stage inside the engine, summed over its batches."""

    @property
    def available(self) -> bool:
        """Whether a batch sent now can be answered (False: only while no process can)."""

    @property
    def batches_together(self) -> bool:
        """Whether the batches in flight merge into one (SGLang's continuous batching): a call
        then waits for none of them in turn (the batcher's admission)."""

    @property
    def parallel(self) -> int:
        """Batches computed side by side (one per replica of an EnginePool, else 1)."""

    def run(self, works: list[Work]) -> list[Result]:
        """The batch's results, in order, computed on this thread (blocking)."""

    async def run_async(self, works: list[Work]) -> list[Result]:
        """``run`` from the event loop: an engine process sends the batch over its pipe, an
        in-process engine computes it in a worker thread. Each result has ``started`` stamped."""

    def on_state(self, hook: Callable[[bool], object]) -> None:
        """``hook(available)`` on each change of ``available``, from any thread (an engine whose
        availability never changes never calls it)."""

    def replica_states(self) -> list[ReplicaState]:
        """Each engine process (or the in-process engine) with its state and the model it holds:
        every one that is ``ready`` holds ``version``, the others serve nothing."""

    def close(self) -> None:
        """Stops the engine (its processes, its threads); bounded. Calling it twice is harmless."""


class Runs(Protocol):
    def run(self, works: list[Work]) -> list[Result]: ...


class EngineBuilder(Protocol):
    """Builds the engine ``kind`` for ``artifact`` in this process (``serve.factory.make_engine``,
    or a builder handed to the server for an engine of its own, e.g. the benchmarks' naive
    baseline). An engine process calls it in the child: it must pickle (a module-level function)."""

    def __call__(self, kind: str, artifact: str, device: str, cache: CacheConfig | None = None,
                 retrieval: RetrievalConfig | None = None, scoring: ScoringConfig | None = None) -> Engine: ...


def run_stamped(engine: Runs, works: list[Work]) -> list[Result]:
    """``engine.run(works)``, each result stamped with the time the batch began."""
    started = time.monotonic()
    try:
        results = engine.run(works)
    except PartlyFailed as e:
        for r in e.outcomes:
            if isinstance(r, Result):
                r.started = started
        raise
    for r in results:
        r.started = started
    return results


class InProcessEngine(ABC):
    """What the contract asks of an engine that computes in this process (TorchEngine,
    SGLangEngine) beyond ``run`` and the artifact's fields: always available, one batch per
    call, ``run_async`` on worker threads of its own (torch ops and SGLang's client release the
    GIL, so the loop keeps serving while a batch computes; the batcher bounds how many run)."""

    batches_together = False
    parallel = 1
    path: str | None = None
    version: str  # (set by each engine from its artifact)
    threads = 8  # run_async's worker threads at most (the batcher's max_inflight bounds their use)

    @property
    def available(self) -> bool:
        return True

    @abstractmethod
    def run(self, works: list[Work]) -> list[Result]: ...

    def on_state(self, hook: Callable[[bool], object]) -> None:  # noqa: B027 - empty on purpose, not abstract
        """Nothing to tell: an engine in this process is available while the process lives."""

    def pin_to(self, cpus: tuple[int, ...]) -> None:  # noqa: B027 - empty on purpose, not abstract
        """Runs the processes of its own on ``cpus`` (``serve.engine_cpus``'s plan for the engine,
        off the front end's): none here; SGLang's engine has its scheduler and detokenizer."""

    def replica_states(self) -> list[ReplicaState]:
        return [ReplicaState("in-process", "ready", self.version)]

    async def run_async(self, works: list[Work]) -> list[Result]:
        return await asyncio.get_running_loop().run_in_executor(self._executor(), run_stamped, self, works)

    def _executor(self) -> ThreadPoolExecutor:
        pool = self.__dict__.get("_pool")
        if pool is None:
            with _POOL_LOCK:
                pool = self.__dict__.setdefault(
                    "_pool", ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="engine"))
        return pool

    def close(self) -> None:
        """Lets the worker threads go (a batch in flight finishes)."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


_POOL_LOCK = threading.Lock()
