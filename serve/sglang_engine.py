"""The SGLang engine's front end: users' encoded histories live in SGLang's KV pool and radix cache.

Three modules, two processes::

    this process                                       SGLang's scheduler process
    SGLangEngine (here): works -> requests,            sglang_models/genrec_tower.GenRecHSTU:
      answers -> Results                                 the tower over SGLang's KV pool
    sglang_runtime: the sglang.Engine(s), faults,      sglang_models/codec: the answer rows
      deadlines (the one module here importing SGLang)   (read here with the same module)

What happens where:

    this process (SGLangEngine)                SGLang's scheduler process (GenRecHSTU)
    ----------------------------------------   --------------------------------------------
    validate; each work's history window       the radix cache matches the longest cached
    -> one token id per event (a keyed hash      prefix of the user's tokens (cache salt =
       of item, action, its time, the next       user id); only the rest is prefilled, in
       event's time) + the events and the        chunks, with the batch's other requests
       work as the request's custom params     per new token: the artifact's (quantized)
       (one request per work, all in flight)     lookups, then each HSTU layer writes its
                                                 K/V to the pool (slot time beside it) and
                                                 attends over the request's slots
                                               at a request's last token: its user vector,
                                                 retrieval (exact top-k, exclusions), and
                                                 the candidates (given or retrieved) scored
                                                 against the history's K/V in the pool
    order by the objective                  <- one codec row per request (int64 positions)

Why the ids mean "the same history": token j's keys and values depend on events 0..j and on
its query time (the next event's time; the last event's is the request time), all of which
its id and its place in the radix path pin down. The ids are SipHash-2-4 of the event under a
key drawn per engine (``event_token_ids``): a caller cannot build an id equal to another event's
to read or poison a user's cached K/V. SGLang always prefills a request's last token, so the
last event (queried at the request time) is recomputed on every call and its row gives the user
vector. Candidates never enter the pool: they are scored in the same forward against the
history's pooled keys / values.

What the radix cache keeps: a user's entries under the cache salt ``u:<user id>`` at priority 1
(SGLang's "priority" eviction policy); requests nobody can match again (no user id, a decode from
a given vector) under a salt of their own at priority 0: evicted before any user's.

Generative retrieval (a model with a semantic-ID decoder): the work's one request asks for the
beam too (payload ``beam``); the model decodes it from the user vector in the same forward with
the torch engine's own ``serve.retrieval.generate`` (``SIDDecoder.beam_search``), fuses it with
the dense top-k for source "both" and ranks the result when the work ranks: one SGLang request
per work, as for dense retrieval. ``generate`` (a given user vector) is one one-token request
per work whose payload carries the vector. Choice and figures:
benchmarks/notes/2026-12-05-sid-sglang-fast.md (the built-in beam search it replaced:
2026-12-03-sid-sglang.md).

Faults (``serve.sglang_runtime``): a failed forward fails its call (INTERNAL, ``ModelForwardError``
naming the reason) and the user's cached entries are not matched again; a runtime whose process
ends fails over to the warm standby (``standby``: the calls in flight run again there) or fails
its calls UNAVAILABLE naming the cause while a new one starts; a call past its deadline has its
SGLang requests aborted (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import ctypes
import json
import logging
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from genrec.kernels import hstu_native
from genrec.serve import sglang_runtime
from genrec.serve.accounting import mark, stamp
from genrec.serve.ann import RetrievalConfig
from genrec.serve.batcher import DeadlineExceeded, ShuttingDown
from genrec.serve.catalogue import read_served
from genrec.serve.contract import InProcessEngine, PartlyFailed, Result, WorkFailed
from genrec.serve.layout import pack_users
from genrec.serve.packed import packed_covers
from genrec.serve.ranking import Ranking
from genrec.serve.requests import Work
from genrec.serve.retrieval import merge_sources
from genrec.serve.scoring import check_precision
from genrec.serve.sglang_models.codec import (
    ERROR_INFO,
    FAILED,
    PAYLOAD,
    VOCAB,
    Answer,
    decode_row,
    pack_events,
    pack_ints,
)

log = logging.getLogger("genrec.serve.sglang")
CALL_TIMEOUT_S = 60.0  # the bound on a call whose works carry no deadline (a direct caller's)
MAX_SALTED = 1 << 16  # users whose cache salt moved on after a failed forward (past this: everyone's moves)


class SGLangUnavailable(ShuttingDown):
    """SGLang's runtime ended under the call and no standby could take it (UNAVAILABLE: the
    server maps ``ShuttingDown`` to it; the message names the cause)."""


class ModelForwardError(WorkFailed):
    """The model's forward failed for a request of the call (INTERNAL; the message and the
    scheduler's log name the reason). The engine goes on serving."""


# ----- event token ids: SipHash-2-4 of (item, action, time, query time) under a secret key --------
_U64 = np.uint64


def _rotl(x: np.ndarray, b: int) -> np.ndarray:
    return (x << _U64(b)) | (x >> _U64(64 - b))


def _rounds(v: list[np.ndarray], n: int) -> None:
    for _ in range(n):
        v[0] += v[1]; v[1] = _rotl(v[1], 13); v[1] ^= v[0]; v[0] = _rotl(v[0], 32)  # noqa: E702
        v[2] += v[3]; v[3] = _rotl(v[3], 16); v[3] ^= v[2]  # noqa: E702
        v[0] += v[3]; v[3] = _rotl(v[3], 21); v[3] ^= v[0]  # noqa: E702
        v[2] += v[1]; v[1] = _rotl(v[1], 17); v[1] ^= v[2]; v[2] = _rotl(v[2], 32)  # noqa: E702


def _sip_key(key: bytes) -> tuple[int, int]:
    """SipHash's two key words of a 16-byte ``key``."""
    if len(key) != 16:
        raise ValueError("SipHash takes a 16-byte key")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


def siphash24_words(key: bytes, words: list[np.ndarray]) -> np.ndarray:
    """SipHash-2-4 (Aumasson & Bernstein) under the 16-byte ``key`` of the messages whose
    little-endian 64-bit words are ``words`` (each [n] int64/uint64: message i is
    words[0][i], words[1][i], ...) -> [n] uint64."""
    k0, k1 = map(_U64, _sip_key(key))
    n = words[0].shape
    with np.errstate(over="ignore"):
        v = [np.full(n, k0 ^ _U64(0x736F6D6570736575)), np.full(n, k1 ^ _U64(0x646F72616E646F6D)),
             np.full(n, k0 ^ _U64(0x6C7967656E657261)), np.full(n, k1 ^ _U64(0x7465646279746573))]
        for w in words:
            m = np.ascontiguousarray(w).astype(np.int64, copy=False).view(np.uint64)
            v[3] ^= m
            _rounds(v, 2)
            v[0] ^= m
        b = _U64(((8 * len(words)) & 0xFF) << 56)
        v[3] ^= b
        _rounds(v, 2)
        v[0] ^= b
        v[2] ^= _U64(0xFF)
        _rounds(v, 4)
        return v[0] ^ v[1] ^ v[2] ^ v[3]


def event_token_ids(key: bytes, items: np.ndarray, actions: np.ndarray, times: np.ndarray,
                    query_times: np.ndarray) -> np.ndarray:
    """[n] int64 token ids (63 bits of a keyed SipHash) of events: equal ids <=> equal (item,
    action, time, query time), up to collisions no caller without ``key`` can aim for. In the
    native library's loop where it built (``genrec_siphash_words``: 1.0 ms -> ~0.02 ms at
    8,000 events), else :func:`siphash24_words` in NumPy; the same ids either way."""
    cols = [np.ascontiguousarray(c, dtype=np.int64) for c in (items, actions, times, query_times)]
    lib = hstu_native.library()
    if lib is None:
        return (siphash24_words(key, cols) >> _U64(1)).astype(np.int64)
    k0, k1 = _sip_key(key)
    n = cols[0].size
    if any(c.size != n for c in cols):
        raise ValueError("the event columns differ in length")
    out = np.empty(n, np.int64)
    words = (ctypes.c_void_p * 4)(*(hstu_native.ptr(c) for c in cols))
    rc = lib.genrec_siphash_words(k0, k1, 4, words, n, 1, hstu_native.ptr(out))
    if rc:
        raise RuntimeError(f"genrec_siphash_words failed ({rc})")
    return out


@dataclass
class _Req:
    """One SGLang request: token ids, genrec's payload, its cache salt, and whether its entries
    can be matched again (a user's)."""

    ids: list[int]
    payload: dict
    key: str
    keep: bool = False


class _Retrying(Exception):
    """(internal) the runtime failed under a call that may run again on its replacement."""


class SGLangEngine(InProcessEngine):
    """Same contract (serve.contract.Engine) and answers as TorchEngine; histories cached in
    SGLang's KV pool. This front end reads the artifact's configs, catalogue and semantic IDs
    (serve.catalogue.read_served), never its model: the model runs in SGLang's scheduler
    (GenRecHSTU).

    ``pool_tokens``: the KV pool's size in tokens (size it for the active users' histories:
    bytes per token = layers x heads x (qk + v dims) x 4); ``window_block``: the history
    window's step (``serve.requests.history_window``); ``chunk_tokens``: chunked prefill's
    chunk; ``threads``: the model's intra-op threads in SGLang's scheduler (one: its many small ops
    stall on an OpenMP barrier whenever a core is busy elsewhere; 0: torch's default).
    A model with a semantic-ID decoder also decodes beams (``generate``; ``run`` for works whose
    source is generative or both), in the model's forward: ``max_beam``: the widest beam a
    request may ask for. ``standby``: keep a second SGLang runtime warm that takes over at
    once if the active one's process ends (its own pool: twice the memory; the server's
    factory turns it on); without, calls fail UNAVAILABLE until a new runtime is up.
    ``candidate_precision``: the candidates' scoring precision in the model's process, as
    ``TorchEngine``'s ([serve.scoring]: fp32, bf16 or auto)."""

    name = "sglang"
    batches_together = True  # the batches in flight merge in SGLang's scheduler (serve.batcher admission)

    def __init__(self, artifact: str | Path, device: str = "cpu", pool_tokens: int = 262144, window_block: int = 1,
                 chunk_tokens: int = 4096, max_running: int = 64, threads: int = 1, max_beam: int = 256,
                 standby: bool = False, retrieval: RetrievalConfig | None = None,
                 candidate_precision: str = "fp32") -> None:
        retrieval = retrieval or RetrievalConfig()
        check_precision(candidate_precision)  # here, not in SGLang's scheduler where the model reads it
        served = read_served(artifact, retrieval)
        if not packed_covers(served.model, served.embedding):
            raise ValueError("the SGLang engine serves HSTU models with the summed action encoding; "
                             "serve this model with engine = \"torch\"")
        self.artifact, self.manifest, self.schema, self.version = str(artifact), served.manifest, served.schema, served.version
        self.tower, self.corpus_np = served.model.tower, served.ids
        self.ranking = Ranking(self.schema.tasks)
        self.stages: dict[str, float] = {}
        if window_block < 1:
            raise ValueError(f"serve.cache.window_block = {window_block}; it must be at least 1")
        self.cap = self.schema.max_history
        self.window_block = min(window_block, self.cap)  # at most the window itself
        c = served.model.hstu.kv_dims()
        self.bytes_per_token = c.layers * (c.key_width + c.value_width) * 4
        self.pool_tokens = pool_tokens
        self.has_action = "action" in served.embedding.sequence_features
        self._stats = {"hits": 0, "misses": 0, "history_tokens": 0, "cached_tokens": 0, "failed_requests": 0}
        self._lock = threading.Lock()
        self._key = secrets.token_bytes(16)  # event token ids' hash key: this engine's only
        self._salted: dict[str, int] = {}  # user id -> generation of its cache salt (after a failed forward)
        self._generation = 0  # everyone's (past MAX_SALTED)
        self.generative = served.sid is not None  # the model has a semantic-ID decoder
        self.max_beam = max_beam if self.generative else 0
        self.closed = False
        sglang_runtime.prepare_environment(device)
        if not sglang_runtime.install_sigquit_handler():
            log.warning("SGLangEngine built off the main thread with no SIGQUIT handler installed: a fault in "
                        "SGLang's scheduler would end this process (call serve.sglang_runtime."
                        "install_sigquit_handler() on the main thread first)")
        self.ckpt = Path(tempfile.mkdtemp(prefix="genrec-sglang-"))
        try:
            cfg = {"architectures": ["GenRecHSTU"], "model_type": "llama", "hidden_size": served.embedding.dim,
                   "num_attention_heads": c.heads, "num_key_value_heads": c.heads, "head_dim": c.key_dim,
                   "v_head_dim": c.value_dim, "num_hidden_layers": c.layers, "intermediate_size": 1,
                   "vocab_size": VOCAB,
                   "max_position_embeddings": served.model.max_seq_len + 16,  # SGLang keeps a few positions back
                   "torch_dtype": "float32", "genrec_artifact": str(Path(artifact).resolve()),
                   "genrec_threads": threads,
                   # [serve.retrieval]: the model process's catalogue searches as the torch engine's would
                   "genrec_retrieval": asdict(retrieval),
                   # [serve.scoring]: the candidates' precision, as the torch engine's (TorchEngine)
                   "genrec_candidate_precision": candidate_precision}
            (self.ckpt / "config.json").write_text(json.dumps(cfg))
            save_file({"_dummy": torch.zeros(1)}, str(self.ckpt / "model.safetensors"))
            from genrec.serve.sglang_models.genrec_tower import KeepLogits

            self.processor = KeepLogits.to_str()
            kwargs = dict(model_path=str(self.ckpt), device=device, dtype="float32", skip_tokenizer_init=True,
                          attention_backend="torch_native", disable_cuda_graph=True, chunked_prefill_size=chunk_tokens,
                          max_prefill_tokens=chunk_tokens, max_total_tokens=pool_tokens,
                          max_running_requests=max_running, mem_fraction_static=0.3,
                          enable_custom_logit_processor=True, return_hidden_states_mode="last", sleep_on_idle=True,
                          radix_eviction_policy="priority", log_level="warning")
            self.runtimes = sglang_runtime.Runtimes(kwargs, standby, self.ckpt)
        except BaseException:
            shutil.rmtree(self.ckpt, ignore_errors=True)
            raise

    # ----- the engine contract beyond run ----------------------------------------------------
    @property
    def available(self) -> bool:
        """False only while no SGLang runtime is up (the active one ended, no standby was warm)."""
        return self.runtimes.available

    def on_state(self, hook: Callable[[bool], object]) -> None:
        self.runtimes.hooks.append(hook)

    def pin_to(self, cpus: tuple[int, ...]) -> None:
        """SGLang's processes (its scheduler runs the model) on ``cpus``, off the front end's:
        ``genrec serve`` plans them from ``serve.engine_cpus`` as it does the torch engine's
        process (serve.worker.plan_cpus)."""
        self.runtimes.pin_to(cpus)

    def close(self) -> None:
        """Stops SGLang's processes (this engine's only), their loops, and removes the model folder."""
        if self.closed:
            return
        self.closed = True
        try:
            self.runtimes.close()
        finally:
            shutil.rmtree(self.ckpt, ignore_errors=True)
            super().close()  # the threads run_async hands batches to

    def cache_stats(self) -> dict:
        """Counters since start: calls that reused cached tokens (hits) or none (misses),
        history tokens and how many of them came from the radix cache, requests whose forward
        failed, runtime failovers; the pool's capacity. (SGLang's radix cache does not report its
        evictions or use to the client.)"""
        with self._lock:
            out = dict(self._stats)
        out.update(capacity_tokens=self.pool_tokens, bytes_per_token=self.bytes_per_token,
                   failovers=self.runtimes.failovers)
        return out

    # ----- requests: one per work ------------------------------------------------------------
    def _salt(self, user_id: str) -> str:
        with self._lock:
            return f"u{self._generation}.{self._salted.get(user_id, 0)}:{user_id}"

    def _spoil(self, user_ids: list[str]) -> None:
        """After a failed forward: those users' cached entries (their K/V maybe half written) are
        never matched again (a new salt); they age out of the pool first-in-line as any entry."""
        with self._lock:
            for u in user_ids:
                self._salted[u] = self._salted.get(u, 0) + 1
            if len(self._salted) > MAX_SALTED:
                self._salted.clear()
                self._generation += 1

    def _request(self, w: Work) -> _Req:
        """A work's request: its history as token ids, the payload, its user's salt. The model
        retrieves from the work's source (the dense top-k, the decoder's beam, both fused) and
        ranks the given candidates or what it retrieved, all in the forward that ends it."""
        items, actions, tk, tq, _, _ = pack_users([w.user], self.cap, self.has_action, self.window_block)
        ids = event_token_ids(self._key, items, actions, tk, tq).tolist()
        retrieve = w.kind == "retrieve" or w.candidates is None
        # what Ranking.plan will rank (a model without tasks has nothing to score: run() fills zeros)
        none = np.zeros(0, np.int64)
        ranks = bool(self.schema.tasks) and 0 in self.ranking.plan([w], {0: (none, none)} if retrieve else {})
        rank = "none" if not ranks else ("retrieved" if retrieve else "given")
        excluded = w.excluded() if retrieve else None
        payload = {"events": pack_events(items, actions, tk, tq),
                   "k": int(w.retrieve_k) if retrieve else 0, "source": w.source,
                   "beam": self._beam_of(w) if retrieve and w.source != "dense" else 0,
                   "excluded": pack_ints(excluded),
                   "rank": rank, "candidates": pack_ints(w.candidates) if rank == "given" else None,
                   "context": {k: v.tolist() for k, v in w.user.context.items()}}
        # a user's entries are matched only against its own; no id: a salt of its own, evicted first
        if w.user.user_id:
            return _Req(ids, payload, self._salt(w.user.user_id), keep=True)
        return _Req(ids, payload, f"anon:{uuid.uuid4().hex}")

    def _beam_of(self, w: Work) -> int:
        beam = w.beam or self.schema.beam_width
        if not 1 <= beam <= self.max_beam:
            raise ValueError(f"beam {beam}: this SGLang engine decodes beams of 1 to {self.max_beam} "
                             f"(SGLangEngine(max_beam=...); serve.limits.max_beam)")
        return beam

    @staticmethod
    def _params(r: _Req) -> dict:
        """Greedy, one token: the answer is the model's row; nothing is sampled."""
        return {"max_new_tokens": 1, "temperature": 0.0, "custom_params": {PAYLOAD: r.payload}}

    async def _generate(self, rt: sglang_runtime.Runtime, reqs: list[_Req], rids: list[str]) -> list[dict]:
        """``reqs`` through ``Engine.async_generate``: a user's at priority 1, the rest at 0 (the
        radix cache's eviction order), as two batches in flight together."""
        import asyncio

        groups = [[i for i, r in enumerate(reqs) if r.keep], [i for i, r in enumerate(reqs) if not r.keep]]

        async def one(index: list[int], priority: int) -> list[dict]:
            if not index:
                return []
            rs = [reqs[i] for i in index]
            out = await rt.engine.async_generate(
                input_ids=[r.ids for r in rs], sampling_params=[self._params(r) for r in rs],
                custom_logit_processor=[self.processor] * len(rs), return_hidden_states=["last"] * len(rs),
                rid=[rids[i] for i in index], cache_salt=[r.key for r in rs], priority=priority)
            return out if isinstance(out, list) else [out]

        got = await asyncio.gather(one(groups[0], 1), one(groups[1], 0))
        outs: list[dict] = [{}] * len(reqs)
        for index, res in zip(groups, got):
            for i, o in zip(index, res):
                outs[i] = o
        return outs

    def send(self, reqs: list[_Req], deadline: float) -> list[dict]:
        """``reqs`` on the active runtime -> SGLang's outputs, in order; bounded by ``deadline``
        (time.monotonic()): past it the requests are aborted (DeadlineExceeded). A runtime that
        ends under the call raises ``_Retrying`` (the caller may run the call again)."""
        rt = self._runtime(deadline)
        rids = [uuid.uuid4().hex for _ in reqs]
        try:
            return rt.call(lambda: self._generate(rt, reqs, rids), rids, deadline)  # type: ignore[return-value]
        except TimeoutError as e:
            raise DeadlineExceeded(str(e)) from e
        except sglang_runtime.RuntimeFailed as e:
            raise _Retrying(str(e)) from e

    def _runtime(self, deadline: float) -> sglang_runtime.Runtime:
        try:
            return self.runtimes.current(deadline)
        except sglang_runtime.RuntimeFailed as e:
            raise SGLangUnavailable(str(e)) from e

    def _deadline(self, works: list[Work]) -> float:
        """The call's bound: its latest work's deadline (a batch fails or succeeds as one)."""
        latest = max((w.deadline for w in works), default=float("inf"))
        return latest if latest != float("inf") else time.monotonic() + CALL_TIMEOUT_S

    def _failures(self, reqs: list[_Req], outs: list[dict]) -> list[tuple[int, str]]:
        """The requests whose forward failed: (index, reason)."""
        bad = []
        for i, o in enumerate(outs):
            reasons = [e for e in (o.get("meta_info", {}).get(ERROR_INFO) or []) if e]
            if reasons:
                bad.append((i, reasons[-1]))
            elif decode_row(self._last(o), 0).status == FAILED:
                bad.append((i, "the model's forward failed"))
        return bad

    def _raise_failed(self, reqs: list[_Req], outs: list[dict], works: list[Work] | None = None) -> None:
        bad = dict(self._failures(reqs, outs))
        if not bad:
            return
        self._count_failed(list(bad), works)
        raise self._batch_error(bad, len(reqs))

    @staticmethod
    def _batch_error(bad: dict[int, str], n: int) -> ModelForwardError:
        """The error of a call whose ``n`` requests include the failed ``bad`` (index -> reason)."""
        return ModelForwardError(f"SGLang model forward failed for {len(bad)} of {n} requests: {next(iter(bad.values()))}")

    def _count_failed(self, failed: list[int], works: list[Work] | None) -> None:
        """The requests ``failed`` (indices) counted, their works' users' cache salts moved on."""
        if works is not None:
            self._spoil([works[i].user.user_id for i in failed if i < len(works) and works[i].user.user_id])
        with self._lock:
            self._stats["failed_requests"] += len(failed)

    def _call(self, reqs: list[_Req], deadline: float, works: list[Work] | None = None) -> list[Answer]:
        """Sends ``reqs`` in one batch -> their answers (``codec`` rows); a failed forward raises
        ``ModelForwardError`` (and moves the failed works' users' cache salts on)."""
        outs = self.send(reqs, deadline)
        self._raise_failed(reqs, outs, works)
        return [decode_row(self._last(o), len(self.schema.tasks)) for o in outs]

    def _generated(self, a: Answer) -> tuple[np.ndarray, np.ndarray]:
        """A row's beam -> (item ids, log-probabilities), best first."""
        return self.corpus_np[a.gen_positions], a.gen_scores

    def _failover(self, fn: Callable[[float], object], deadline: float) -> object:
        """``fn(deadline)``, run once more if SGLang's runtime ended under it (on the standby that
        took over, or the replacement if one comes up by the deadline)."""
        try:
            return fn(deadline)
        except _Retrying as e:
            log.warning("SGLang runtime ended under a call (%s): running it again", e)
            first = str(e)
        try:
            return fn(deadline)
        except _Retrying as e:
            raise SGLangUnavailable(f"SGLang runtime failed under the call twice: {first}; {e}") from e

    def generate(self, users: torch.Tensor, works: list[tuple[int, Work]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """TorchEngine.generate's answers, decoded in SGLang's scheduler: one one-token request
        per work carrying its user vector (row i of ``users`` [B, D]), its beam and exclusions;
        the model decodes the batch's beams together (``SIDDecoder.beam_search``)."""
        if not self.generative:
            raise ValueError("this model has no semantic-ID decoder (model.sid)")

        def call(deadline: float) -> dict:
            reqs = []
            for i, w in works:
                seen = w.excluded()
                reqs.append(_Req([0], {"prompt": users[i].float().tolist(), "beam": self._beam_of(w),
                                       "excluded": pack_ints(seen)},
                                 f"gen:{uuid.uuid4().hex}"))
            return {i: self._generated(a) for (i, _), a in zip(works, self._call(reqs, deadline))}

        return self._failover(call, self._deadline([w for _, w in works]))  # type: ignore[return-value]

    @staticmethod
    def _last(o: dict) -> list:
        hs = o["meta_info"]["hidden_states"]  # the "last" row (a list of rows on some paths: the last)
        return hs[-1] if hs and isinstance(hs[0], list) else hs

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        t0 = time.perf_counter()
        return self._failover(lambda deadline: self._run(works, deadline, t0), self._deadline(works))  # type: ignore[return-value]

    def _run(self, works: list[Work], deadline: float, t0: float) -> list[Result]:
        """The batch's results; where the forward failed for some of its requests, PartlyFailed
        with the others' results and a ModelForwardError for each of those (all failed: that
        error for the batch). The failed works' users' cache salts move on."""
        reqs = [self._request(w) for w in works]
        outs = self.send(reqs, deadline)
        bad = dict(self._failures(reqs, outs))
        if not bad:
            return self._results(works, reqs, outs, t0)
        self._count_failed(list(bad), works)
        if len(bad) == len(reqs):
            raise self._batch_error(bad, len(reqs))
        good = [i for i in range(len(works)) if i not in bad]
        done = iter(self._results([works[i] for i in good], [reqs[i] for i in good], [outs[i] for i in good], t0))
        raise PartlyFailed([ModelForwardError(f"the model's forward failed for this request: {bad[i]}") if i in bad
                            else next(done) for i in range(len(works))])

    def _results(self, works: list[Work], reqs: list[_Req], outs: list[dict], t0: float) -> list[Result]:
        """The works' results from their SGLang outputs (none failed)."""
        retrieving = [(i, w) for i, w in enumerate(works) if w.kind == "retrieve" or w.candidates is None]
        dense, generated, probs, computed = {}, {}, {}, {}
        tasks = len(self.schema.tasks)
        hist = cached = hits = 0
        for i, (o, r) in enumerate(zip(outs, reqs)):
            a, p = decode_row(self._last(o), tasks), r.payload
            computed[i] = a.computed
            if p["k"] and p["source"] != "generative":
                dense[i] = (self.corpus_np[a.positions], a.scores)
            if p["beam"]:
                generated[i] = self._generated(a)
            if p["rank"] != "none":
                probs[i] = a.probs
            n, c = len(r.ids), int(o["meta_info"].get("cached_tokens", 0))
            hist, cached, hits = hist + n, cached + c, hits + (c > 0)
        with self._lock:
            s = self._stats
            s["hits"] += hits
            s["misses"] += len(works) - hits
            s["history_tokens"] += hist
            s["cached_tokens"] += cached
        # the model ranked what it merged from the same two lists (merge_sources is a function of them)
        retrieved = merge_sources(retrieving, dense, generated) if generated else dense
        to_rank = self.ranking.plan(works, retrieved)
        for i in to_rank:
            if i in probs and probs[i].shape[0] != to_rank[i][0].size:
                raise RuntimeError(f"the SGLang model ranked {probs[i].shape[0]} candidates of work {i}, "
                                   f"the front end's plan {to_rank[i][0].size}")
        for i in to_rank:  # a model without tasks ranks nothing: its candidates keep their order
            probs.setdefault(i, np.zeros((to_rank[i][0].size, tasks), np.float32))
        t = time.perf_counter()
        results = self.ranking.results(works, retrieved, to_rank, probs)
        mark(self.stages, "order", t)
        stamp(results, t0)
        gauges = {"capacity_tokens": self.pool_tokens, "bytes": self.pool_tokens * self.bytes_per_token}
        for i, (res, o, q, w) in enumerate(zip(results, outs, reqs, works)):
            res.history_tokens, res.cached_tokens = len(q.ids), int(o["meta_info"].get("cached_tokens", 0))
            res.prefilled_tokens = computed[i]  # by the pass that ended the request (all of them, unchunked)
            res.cache_lookup, res.cache_gauges = bool(w.user.user_id), gauges
        return results
