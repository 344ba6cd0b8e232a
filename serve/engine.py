"""The PyTorch engine: a batch of validated works in, results out, running the model from models/.

Flow of one batch (``TorchEngine.run``), each step a part of its own:

    encode     the users' histories, laid out (serve.layout: packed or jagged), through the
               model's tower -> user vectors [B, D] + every layer's K/V (encoded once, M-FALCON)
    retrieve   serve.catalogue / serve.retrieval: exact top retrieve_k of the catalogue, and/or
               the semantic-ID decoder's beam, fused for source "both"
    rank       serve.ranking: retrieved or given candidates scored against the histories'
               K/V -> task probabilities; then the order by the objective (retrieval score,
               a task, or eCPM = bid x prod(tasks)) and each Recommend's top_k
    account    serve.accounting: seconds per stage, history / cached / evicted tokens

The engine selects a backend, never a model: on CPU, an HSTU model with summed action tokens
takes the *packed* path (serve.packed: the histories laid out once in numpy, then the model's
``encode_history_tokens`` / ``extend``) with the tower's ``backend="native"`` (its C++ kernel,
``kernels.hstu_native``) where the library builds, else ``backend="torch"``
(``GENREC_NATIVE=0``); on the native path the served tables' gathers, the retrieval top-k and
the ranking MLP run in ``serve.native.ServeKernels``. ``TorchEngine(packed=False)`` keeps the
model's batch path (``collate_users`` -> ``encode_history`` / ``score_candidates``).

With ``kv_cache_mb`` (the packed path), calls that carry a ``user_id`` keep their encoded
history in a per-user K/V cache (serve.kvcache); the user's next call encodes only the events
past the longest prefix it shares with the cached window (``tower.extend_paged``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from genrec.models.recommender import GenerativeRecommender, HistoryState, TowerBackend
from genrec.quant.load import load_model
from genrec.serve.accounting import Accounting, mark, stamp
from genrec.serve.ann import RetrievalConfig
from genrec.serve.catalogue import Catalogue, version_of
from genrec.serve.contract import InProcessEngine, Result
from genrec.serve.kvcache import KVCache, token_bytes
from genrec.serve.layout import collate_users, schema_of
from genrec.serve.packed import BF16_FROM_PAIRS, PackedPath, packed_supports
from genrec.serve.ranking import Ranking, score_jagged
from genrec.serve.requests import UserInput, Work
from genrec.serve.retrieval import Pair, Retrieved, generate, retrieve_sources
from genrec.serve.scoring import check_precision

log = logging.getLogger("genrec.serve")


class TorchEngine(InProcessEngine):
    """The PyTorch engine (the embedded default), CPU or GPU (serve.contract.Engine)."""

    name = "torch"

    def __init__(self, artifact: str | Path, device: str = "cpu", micro_batch: int = 4096,
                 objective_tasks: tuple[str, ...] | None = None, packed: bool | None = None,
                 native: bool | None = None, kv_cache_mb: float = 0.0, window_block: int = 1,
                 padded: bool | None = None, candidate_precision: str = "fp32",
                 retrieval: RetrievalConfig | None = None) -> None:
        """``packed``: run an HSTU model on the packed path (see the module docstring; default:
        on CPU, when the model is one it covers); False keeps the batch path (``padded``: its
        old name, deprecated). ``native``: on that path, the tower's native backend and the
        native lookups and heads (default: where the tower is one it covers and the library
        builds; ``GENREC_NATIVE=0``: off). ``kv_cache_mb``: keep the encoded histories of calls
        with a ``user_id`` in a per-user K/V cache of this many MiB (serve.kvcache; the packed
        path only; 0: off). ``window_block``: the window over long histories moves in steps of
        this many events (``serve.requests.history_window``; a block larger than the model's
        window is the window). ``candidate_precision``: "bf16" scores
        candidates with their attention GEMMs in bf16 (the packed path; ``kernels.hstu_candidates``:
        about twice the fp32 rate on CPUs with AVX512-BF16 or AMX), "fp32" in the model's dtype,
        "auto" bf16 where the CPU has either (:func:`bf16_gemm_fast`) and, beside the native
        kernel, only for micro-batches large enough to gain (``BF16_FROM_PAIRS``). ``retrieval``: exact or ANN
        search of the catalogue ([serve.retrieval], serve.ann.RetrievalConfig; None: its defaults)."""
        if padded is not None:
            warnings.warn("TorchEngine(padded=...) is now packed=...", DeprecationWarning, stacklevel=2)
            packed = padded if packed is None else packed
        self.device = torch.device(device)
        self.model, self.manifest = load_model(artifact, self.device)
        self.artifact, self.micro_batch = str(artifact), micro_batch
        self.schema, self.version = schema_of(self.model), version_of(self.manifest)
        if window_block < 1:
            raise ValueError(f"serve.cache.window_block = {window_block}; it must be at least 1")
        self.window_block = min(window_block, self.schema.max_history)  # at most the window itself
        if packed is None:
            packed = self.device.type == "cpu" and packed_supports(self.model)
        if native is None:
            native = bool(packed) and native_ok(self.model)
        check_precision(candidate_precision)
        bf16 = candidate_precision == "bf16" or (candidate_precision == "auto" and bf16_gemm_fast(self.device))
        if bf16 and self.model.cfg.tower == "hstu" and not self.model.tower.plain_linears():
            if candidate_precision == "bf16":
                raise ValueError("candidate_precision 'bf16' runs the tower's linear layers as bf16 GEMMs; this "
                                 "artifact's dense layers are quantized (int8 / fp8): serve it with fp32 or auto")
            bf16 = False  # (auto: the quantized layers' own forward)
        score: TowerBackend | None = "torch-bf16" if bf16 else None
        # "auto": bf16 only where a micro-batch is large enough for it to win (BF16_FROM_PAIRS)
        score_from = BF16_FROM_PAIRS if candidate_precision == "auto" and native and bf16 else 0
        self.stages: dict[str, float] = {}  # seconds spent per stage, summed over batches
        # the tower's backend on the packed path (the model's methods either way)
        self.packed = (PackedPath(self.model, "native" if native else "torch", micro_batch, self.stages,
                                  self.window_block, score, score_from) if packed else None)
        self.path = ("native" if native else "packed") if packed else "jagged"
        self.catalogue = Catalogue(self.model, self.packed.kernels if self.packed is not None else None,
                                   artifact, self.manifest, retrieval)
        self.schema = replace(self.schema, dense_search=self.catalogue.search)
        self.ranking = Ranking(self.schema.tasks, objective_tasks)
        self.cache = KVCache(int(self._cache_mb(kv_cache_mb) * 2**20), self._token_bytes())
        self.accounting = Accounting(self.cache, self.schema.max_history, self.window_block)
        # batches running now (the server may run several in threads): the cache's entries are
        # grown in place only by a batch that runs alone (serve.packed.PackedPath.encode_cached)
        self.running, self.running_lock = 0, threading.Lock()

    def _cache_mb(self, kv_cache_mb: float) -> float:
        if kv_cache_mb and self.packed is None:  # (extend_paged is the HSTU tower's, on the packed layout)
            log.info("serve.cache.kv_cache_mb: the K/V cache runs on the packed path (an HSTU tower with summed "
                     "actions, on CPU); this engine runs the jagged path, without a cache")
            return 0.0
        return kv_cache_mb

    def _token_bytes(self) -> int:
        """Bytes a cached token costs (1 where nothing is cached: the cache still counts tokens)."""
        if self.packed is None:
            return 1
        c = self.model.tower.kv_dims()
        return token_bytes(c.layers, c.key_width, c.value_width, self.model.dense_dtype.itemsize)

    @property
    def tower(self) -> str:
        return self.model.cfg.tower

    @property
    def corpus_np(self) -> np.ndarray:
        """[N] the catalogue's sorted item ids."""
        return self.catalogue.ids

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        with self.running_lock:
            self.running += 1
        try:
            return self._run(works)
        finally:
            with self.running_lock:
                self.running -= 1

    def _run(self, works: list[Work]) -> list[Result]:
        t0 = time.perf_counter()
        users, state, cached, evicted = self.encode([w.user for w in works])
        t = time.perf_counter()
        need = [(i, w) for i, w in enumerate(works) if w.kind == "retrieve" or w.candidates is None]
        retrieved = self.retrieve_sources(users, need, t)
        to_rank = self.ranking.plan(works, retrieved)
        t = time.perf_counter()
        probs = self.score(state, to_rank)  # (the packed path marks its own steps)
        t = time.perf_counter() if self.packed is not None else mark(self.stages, "rank_candidates", t)
        results = self.ranking.results(works, retrieved, to_rank, probs)
        mark(self.stages, "order", t)
        return self.accounting.account(works, stamp(results, t0), cached, evicted)

    def encode(self, users: list[UserInput]) -> tuple[torch.Tensor, HistoryState, np.ndarray | None,
                                                      np.ndarray | None]:
        """The users' vectors [B, D] and encoded histories, and (with the K/V cache) the tokens
        each reused and evicted [B] (None without)."""
        if self.packed is not None and self.cache.enabled:
            return self.packed.encode_cached(users, self.cache, alone=lambda: self.running == 1)
        if self.packed is not None:  # (lays the batch out itself)
            return (*self.packed.encode(users), None, None)
        t = time.perf_counter()
        batch = collate_users(users, self.model, self.device, window_block=self.window_block)
        t = mark(self.stages, "collate", t)
        vec, state = self.model.encode_history(batch)  # embedding lookups + tower
        mark(self.stages, "encode_history", t)
        return vec, state, None, None

    def retrieve_sources(self, users: torch.Tensor, works: Sequence[tuple[int, Work]],
                         t: float | None = None) -> dict[int, Pair | Retrieved]:
        """Each work's retrieval from its ``Work.source`` (serve.retrieval.retrieve_sources)."""
        return retrieve_sources(self.catalogue, self.model.sid_head, self._default_beam, users, works, self.stages, t)

    def generate(self, users: torch.Tensor, works: Sequence[tuple[int, Work]]) -> dict[int, Pair]:
        """Generative retrieval for works whose vectors are rows of ``users`` [B, D]: {work:
        (item ids, log-probabilities)}, best first (serve.retrieval.generate)."""
        head = self.model.sid_head
        if head is None:  # (decode refuses such requests: ModelCannot)
            raise ValueError("this model has no semantic-ID decoder (model.sid)")
        return generate(head, self.catalogue, users, works, self._default_beam)

    @property
    def _default_beam(self) -> int:
        return self.model.cfg.sid.beam_width

    def score(self, state: HistoryState, to_rank: Mapping[int, tuple[np.ndarray, ...]]) -> dict[int, np.ndarray]:
        """Task probabilities {work: [c, tasks]} of every work's candidates (``to_rank[i][0]``,
        table rows), scored against the encoded histories in micro-batches that mix users."""
        if not to_rank:
            return {}
        if self.packed is not None:
            keys = list(to_rank)
            return dict(zip(keys, self.packed.score(state, keys, [to_rank[i][0] for i in keys])))
        return score_jagged(self.model, state, to_rank, self.micro_batch, self.device)

    def cache_stats(self) -> dict[str, int]:
        """The K/V cache's counters and gauges (``serve.kvcache.KVCache.stats``): hits, misses,
        history_tokens, cached_tokens, evicted_tokens, users, used_tokens, capacity_tokens, bytes."""
        return self.cache.stats()


def native_ok(model: GenerativeRecommender) -> bool:
    """Whether the native path computes this model here (the packed path covers it, the
    tower's native backend does, and the library builds)."""
    return packed_supports(model) and model.tower.native_supported()


def bf16_gemm_fast(device: torch.device) -> bool:
    """Whether bf16 GEMMs outrun fp32 here: a CPU with AVX512-BF16 or AMX tiles (measured on
    an AVX512-BF16 EPYC: ~2x fp32, ``benchmarks.ranking_cached``). Not decided for GPUs here."""
    if device.type != "cpu":
        return False
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(f()) for f in checks if f is not None)
