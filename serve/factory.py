"""Building an engine in this process, and readying a process that holds one.

Both the server (an in-process engine) and an engine process (``serve.worker``'s child)
build engines here, so neither imports the other: ``server -> failover -> worker -> factory``
and ``server -> factory`` (tests/test_layering.py checks that ``serve/`` has no import cycle).
"""

from __future__ import annotations

import gc

from genrec.serve.ann import RetrievalConfig
from genrec.serve.contract import Engine
from genrec.serve.kvcache import CacheConfig
from genrec.serve.scoring import ScoringConfig

# the model's intra-op threads in SGLang's scheduler process, which serve.engine_cpus = "auto"
# gives a CPU of its own (serve.cli.engine_cpus)
SGLANG_THREADS = 1


def make_engine(kind: str, artifact: str, device: str, cache: CacheConfig | None = None,
                retrieval: RetrievalConfig | None = None, scoring: ScoringConfig | None = None) -> Engine:
    """The engine ``kind`` (torch or sglang) for ``artifact``, in this process, with the
    K/V cache and history window of ``cache`` ([serve.cache]; None: each engine's own defaults),
    the catalogue search of ``retrieval`` ([serve.retrieval]) and the candidates' precision of
    ``scoring`` ([serve.scoring]).
    Engines are imported lazily: the SGLang one pulls in SGLang, which only that engine needs."""
    precision = (scoring or ScoringConfig()).candidate_precision
    if kind == "sglang":
        from genrec.serve.sglang_engine import SGLangEngine

        # a warm standby runtime: a fault in SGLang's scheduler fails over instead of failing calls
        if cache is None:
            return SGLangEngine(artifact, device=device, standby=True, retrieval=retrieval, threads=SGLANG_THREADS,
                                candidate_precision=precision)
        return SGLangEngine(artifact, device=device, pool_tokens=cache.pool_tokens, window_block=cache.window_block,
                            standby=True, retrieval=retrieval, threads=SGLANG_THREADS, candidate_precision=precision)
    if kind != "torch":
        raise ValueError(f"engine '{kind}': serve torch or sglang (the naive baseline is the benchmarks': "
                         "python -m genrec.benchmarks.naive_engine)")
    from genrec.serve.engine import TorchEngine

    if cache is None:
        return TorchEngine(artifact, device=device, retrieval=retrieval, candidate_precision=precision)
    return TorchEngine(artifact, device=device, kv_cache_mb=cache.kv_cache_mb, window_block=cache.window_block,
                       retrieval=retrieval, candidate_precision=precision)


def quiet_gc() -> None:
    """Moves every object alive now (torch, grpc, the model: hundreds of thousands of objects)
    into the collector's permanent generation. Otherwise a full collection, which Python starts
    now and then as requests allocate, walks them all with the process stalled: a pause far
    past any p99 budget. Called once a process has loaded what it keeps; garbage made later is
    still collected."""
    gc.collect()
    gc.freeze()
