"""Engines: a batch of validated work items in, results out, running the model from models/.

Flow of one batch (what ``TorchEngine.run`` does):

    users' histories --collate--> SequenceBatch --model.encode_history--> user vectors [B, D]
        + per-layer K/V cache (the history is encoded once, M-FALCON)
    retrieval: user vectors @ catalogue matrix [N, D] -> history masked -> top retrieve_k
               (and/or, per ``Work.source``, the semantic-ID decoder's beam from the same user
               vectors: ``generate``; with "both" the two lists are fused: ``merge_sources``)
    ranking:   retrieved or given candidates, in micro-batches, scored against the cache
               (model.score_candidates) -> task probabilities
    order:     by the objective: retrieval score, a task, or eCPM = bid x prod(tasks)

The engine selects a backend, never a model: on CPU, an HSTU model with summed action
tokens takes the *packed* path (``serve.packed``: the histories laid out once in numpy,
token inputs made without KeyedJaggedTensors, then the model's ``encode_history_tokens`` /
``extend``) with
the tower's ``backend="native"`` (its C++ kernel, ``kernels.hstu_native``) where the library
builds, else ``backend="torch"`` (``GENREC_NATIVE=0``; path "padded", its old name); on the
native path the served tables' gathers, the retrieval top-k and the ranking MLP run in
``serve.native.ServeKernels``. ``TorchEngine(padded=False)`` keeps the batch path
(``collate_users`` -> ``encode_history`` / ``score_candidates``).

With ``kv_cache_mb`` (the packed path), calls that carry a ``user_id`` keep their encoded
history in a per-user K/V cache (``serve.kvcache``); the user's next call encodes only the
events past the longest prefix it shares with the cached window (``tower.extend_paged``), then
everything downstream runs as above. Every result reports its history and cached tokens.

Engines share this interface so the server and the parity test treat them alike; the
SGLang engine (``serve.sglang_engine``) runs the same tower inside SGLang.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from genrec.models.inputs import SequenceBatch, history_capacity
from genrec.models.recommender import GenerativeRecommender
from genrec.quant.artifact import Manifest
from genrec.quant.load import load_model
from genrec.serve.contract import InProcessEngine, Result, run_stamped  # noqa: F401 - re-exported
from genrec.serve.kvcache import KVCache, token_bytes
from genrec.serve.packed import PackedPath, context_kjt, packed_supports  # noqa: F401 - re-exported
from genrec.serve.requests import ModelSchema, UserInput, Work, history_window

_NONE = np.zeros(0, np.int64)
log = logging.getLogger("genrec.serve")
# reciprocal-rank fusion's constant (Cormack et al., 2009): an item at rank r of a list adds
# 1 / (RRF_K + r); 60 keeps a list's head from outweighing agreement between the lists
RRF_K = 60


class Asks(Protocol):
    """What retrieval reads of a work (``Work``; the SGLang model's per-request payload)."""

    @property
    def retrieve_k(self) -> int: ...

    def excluded(self) -> np.ndarray | None: ...


class Retrieved(NamedTuple):
    """What a work retrieved from more than the dense source (``TorchEngine.merge_sources``);
    a dense-only work keeps the plain (ids, scores) pair every engine's ``retrieve`` returns."""

    ids: np.ndarray  # [n] item ids, in the retrieval order
    scores: np.ndarray  # [n] the order: log-probability (generative) or fused score (both)
    dense: np.ndarray  # [n] dense logits, NaN where the dense source did not retrieve the item
    generative: np.ndarray | None  # [n] decoder log-probabilities, NaN where the decoder did not (None: dense only)


def schema_of(model: GenerativeRecommender) -> ModelSchema:
    emb = model.embedding_cfg
    actions = (emb.table_of("action").num_embeddings or 1).bit_length() - 1 if "action" in emb.sequence_features else 0
    tasks = tuple(t.name for t in model.cfg.ranking.tasks)
    tpe = 2 if model.interleaved else 1
    sid = model.sid_head
    cap = history_capacity(model.cfg.max_seq_len, tpe, ranked=bool(tasks))  # as offline evaluation reads
    return ModelSchema(emb, actions, tasks, int(model.corpus_ids.numel()), cap,
                       model.cfg.sid.beam_width if sid is not None else 0, sid.sizes if sid is not None else ())


def collate_users(users: list[UserInput], model: GenerativeRecommender, device: torch.device,
                  candidates: list[np.ndarray] | None = None, window_block: int = 1) -> SequenceBatch:
    """Histories (each cut to the tower's window, :func:`history_window`) -> a SequenceBatch;
    with ``candidates`` (one array per user) they are appended as targets, seen at the request time."""
    cap = schema_of(model).max_history
    cands = candidates or [np.zeros(0, np.int64)] * len(users)
    cut = [slice(history_window(u.items.size, cap, window_block), None) for u in users]
    items = [np.concatenate([u.items[c], k]) for u, c, k in zip(users, cut, cands)]
    lengths = [x.size for x in items]
    keys, values, lens = [model.item_feature], [np.concatenate(items)], list(lengths)
    if "action" in model.sparse.sequence_features:
        keys.append("action")
        values.append(np.concatenate([np.concatenate([u.actions[c], np.zeros(k.size, np.int64)])
                                      for u, c, k in zip(users, cut, cands)]))
        lens += lengths
    times, qtimes = [], []
    for u, c, k in zip(users, cut, cands):
        t = u.times[c]
        times.append(np.concatenate([t, np.full(k.size, u.request_time, np.int64)]))
        qtimes.append(np.concatenate([t[1:], [u.request_time], np.full(k.size, u.request_time, np.int64)]))
    batch = SequenceBatch(
        seq=KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                              lengths=torch.tensor(lens, dtype=torch.int64)),
        max_len=max(lengths), timestamps=torch.from_numpy(np.concatenate(times)),
        query_times=torch.from_numpy(np.concatenate(qtimes)),
        has_time=torch.tensor([u.has_time for u in users], dtype=torch.bool),
    )
    if candidates is not None:
        batch.num_targets = torch.tensor([k.size for k in cands], dtype=torch.int64)
    ctx_names = list(model.embedding_cfg.pooled_features)
    if ctx_names and model.ranking_context:
        batch.context = context_kjt(users, ctx_names)
    return batch.to(device)


class TorchEngine(InProcessEngine):
    """The PyTorch engine (the embedded default), CPU or GPU."""

    name = "torch"

    def __init__(self, artifact: str | Path, device: str = "cpu", micro_batch: int = 4096,
                 objective_tasks: tuple[str, ...] | None = None, padded: bool | None = None,
                 native: bool | None = None, kv_cache_mb: float = 0.0, window_block: int = 1,
                 cache_reuse: str = "auto") -> None:
        """``padded``: run an HSTU model on the packed path (see the module docstring; default:
        on CPU, when the model is one it covers); False keeps the batch path.
        ``native``: on that path, the tower's native backend and the native lookups and heads
        (default: where the tower is one it covers and the library builds; ``GENREC_NATIVE=0``: off).
        ``kv_cache_mb``: keep the encoded histories of calls with a ``user_id`` in a per-user K/V
        cache of this many MiB (``serve.kvcache``; the packed path only; 0: off).
        ``window_block``: the window over long histories moves in steps of this many events
        (``serve.requests.history_window``; ``[serve.cache]``; a block larger than the model's
        window is the window). ``cache_reuse``: which cached
        prefixes are worth reusing (``PackedPath.min_prefix``: "auto", or "always")."""
        self.device = torch.device(device)
        self.model, self.manifest = load_model(artifact, self.device)
        self.artifact = str(artifact)
        self.micro_batch = micro_batch
        self.schema = schema_of(self.model)
        if window_block < 1:
            raise ValueError(f"serve.cache.window_block = {window_block}; it must be at least 1")
        self.window_block = min(window_block, self.schema.max_history)  # at most the window itself
        # eCPM multiplies the predictions of these tasks (default: all, e.g. pCTR x pCVR)
        self.objective_tasks = objective_tasks or self.schema.tasks
        with torch.inference_mode():
            corpus = self.model.corpus_ids
            self.items = torch.cat([self.model.item_embeddings(corpus[i : i + 65536])
                                    for i in range(0, corpus.numel(), 65536)])  # [N, D]
        self.corpus = corpus
        self.corpus_np = corpus.cpu().numpy()
        # [D, N] the catalogue's vectors as the right-hand side of one GEMM (rows contiguous)
        self.items_t = self.items.t().contiguous()
        self.version = version_of(self.manifest)
        if padded is None:
            padded = self.device.type == "cpu" and packed_supports(self.model)
        if native is None:
            native = bool(padded) and native_ok(self.model)
        self.stages: dict[str, float] = {}  # seconds spent per stage, summed over batches
        # the tower's backend on the packed path (the model's methods either way)
        self.packed = (PackedPath(self.model, "native" if native else "torch", micro_batch, self.stages, self.window_block,
                                  cache_reuse) if padded else None)
        if kv_cache_mb and self.packed is None:  # (extend_paged is the HSTU tower's, on the packed layout)
            log.info("serve.cache.kv_cache_mb: the K/V cache runs on the packed path (an HSTU tower with summed "
                        "actions, on CPU); this engine runs the jagged path, without a cache")
            kv_cache_mb = 0
        per_token = 1
        if self.packed is not None:
            c, layers = self.model.tower.layers[0].cfg, len(self.model.tower.layers)
            per_token = token_bytes(layers, c.num_heads * c.qk_dim, c.num_heads * c.v_dim, self.model.dense_dtype.itemsize)
        self.cache = KVCache(int(kv_cache_mb * 2**20), per_token)  # (0 MiB: keeps nothing, counts history tokens)
        self.path = ("native" if native else "padded") if padded else "jagged"
        # the native retrieval reads the catalogue's columns padded to a whole 8-float vector
        self.items_native = (torch.nn.functional.pad(self.items_t.float(), (0, -self.items_t.shape[1] % 8)).contiguous()
                             if native else None)

    @property
    def tower(self) -> str:
        return self.model.cfg.tower

    def _mark(self, stage: str, t0: float) -> float:
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - t0
        return now

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        t0 = t = time.perf_counter()
        fine = self.packed is not None  # it marks its own steps
        cached = evicted = None
        if self.packed is not None and self.cache.enabled:
            users, state, cached, evicted = self.packed.encode_cached([w.user for w in works], self.cache)
        elif self.packed is not None:  # lays the batch out itself
            users, state = self.packed.encode([w.user for w in works])
        else:
            batch = collate_users([w.user for w in works], self.model, self.device, window_block=self.window_block)
            t = self._mark("collate", t)
            users, state = self.model.encode_history(batch)  # embedding lookups + tower
        t = time.perf_counter() if fine else self._mark("encode_history", t)
        need = [(i, w) for i, w in enumerate(works) if w.kind == "retrieve" or w.candidates is None]
        retrieved = self.retrieve_sources(users, need, t)
        t = time.perf_counter()
        to_rank = self.plan_ranking(works, retrieved)
        probs = self.score(state, to_rank)
        t = time.perf_counter() if fine else self._mark("rank_candidates", t)
        return self.account(works, self.finish(works, retrieved, to_rank, probs, t0), cached, evicted)

    def history_tokens(self, user: UserInput) -> int:
        """The tokens of ``user``'s history the tower reads (its window)."""
        n = user.items.size
        return n - history_window(n, self.schema.max_history, self.window_block)

    def account(self, works: list[Work], results: list[Result], cached: np.ndarray | None,
                evicted: np.ndarray | None) -> list[Result]:
        """Each result's history / cached / evicted tokens, and the cache's gauges after the batch."""
        gauges = self.cache.gauges() if cached is not None else None
        tokens = [self.history_tokens(w.user) for w in works]
        if cached is None:  # (encode_cached counted the batch's history tokens itself)
            self.cache.count_history(sum(tokens))
        for i, (w, r) in enumerate(zip(works, results)):
            r.history_tokens = tokens[i]
            if cached is not None and evicted is not None:
                r.cached_tokens, r.evicted_tokens = int(cached[i]), int(evicted[i])
                r.cache_lookup, r.cache_gauges = bool(w.user.user_id), gauges
        return results

    def cache_stats(self) -> dict[str, int]:
        """The K/V cache's counters and gauges (``serve.kvcache.KVCache.stats``): hits, misses,
        history_tokens, cached_tokens, evicted_tokens, users, used_tokens, capacity_tokens, bytes."""
        return self.cache.stats()

    def plan_ranking(self, works: list[Work], retrieved: dict) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """What each work ranks: (table rows, ids to return, bids) -- its given candidates or
        what it retrieved; works that only retrieve rank nothing."""
        to_rank = {}
        for i, w in enumerate(works):
            if w.kind == "retrieve" or (i in retrieved and (not self.schema.tasks or w.objective == "retrieval")):
                continue
            if w.candidates is not None:
                to_rank[i] = _given(w.candidates, w)
            else:
                ids = retrieved[i][0]
                to_rank[i] = (ids, ids, np.ones(ids.size))
        return to_rank

    def finish(self, works: list[Work], retrieved: dict, to_rank: dict, probs: dict, t0: float) -> list[Result]:
        t = time.perf_counter()
        results = []
        for i, w in enumerate(works):
            got = _channels(retrieved[i]) if i in retrieved else None
            if i not in to_rank:  # (a work not ranked is one that retrieved)
                results.append(_retrieved_result(_channels(retrieved[i]), w))
                continue
            _, out_ids, bids = to_rank[i]
            tasks = {t: probs[i][:, j] for j, t in enumerate(self.schema.tasks)}
            results.append(_ranked_result(w, out_ids, self.order(w.objective, tasks, bids, got.scores if got else None),
                                          tasks, got))
        self._mark("order", t)
        ms = (time.perf_counter() - t0) * 1e3
        for r in results:
            r.compute_ms, r.batch_size = ms, len(works)
        return results

    def retrieve_sources(self, users: torch.Tensor, works: list[tuple[int, Work]], t: float | None = None,
                         ) -> dict[int, tuple[np.ndarray, np.ndarray] | Retrieved]:
        """Each work's retrieval from its ``Work.source``: the dense top-k (:meth:`retrieve`),
        the decoder's beam (:meth:`generate`) or both, put together by :meth:`merge_sources`.
        users [B, D] (a work's index is its row). The stages "retrieve_topk" and "generate" are
        timed from ``t`` (default: now)."""
        t = time.perf_counter() if t is None else t
        dense_w = [(i, w) for i, w in works if w.source != "generative"]
        gen_w = [(i, w) for i, w in works if w.source != "dense"]
        dense = self.retrieve(users, dense_w) if dense_w else {}
        t = self._mark("retrieve_topk", t)
        generated = self.generate(users, gen_w) if gen_w else {}
        if gen_w:
            self._mark("generate", t)
        return self.merge_sources(works, dense, generated)

    def generate(self, users: torch.Tensor, works: list[tuple[int, Work]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Generative retrieval: {work: (item ids [n] int64, log-probabilities [n] float32)}, best
        first, from the semantic-ID decoder's beam search (``SIDDecoder.beam_search``) prompted
        with the users' vectors ``users`` [B, D] (work i's is row i: the same vectors dense
        retrieval reads; the decoder normalises its prompt itself). Each work decodes with its own
        ``Work.beam`` (works sharing a beam share one search) and never gets its
        :meth:`Work.excluded` items; ids the beam could not fill and items outside the catalogue
        are left out (n <= beam). The SGLang engine overrides this with its own decoding."""
        head = self.model.sid_head
        if head is None:  # (decode refuses such requests: ModelCannot)
            raise ValueError("this model has no semantic-ID decoder (model.sid)")
        dtype = next(head.parameters()).dtype
        groups: dict[int, list[tuple[int, Work]]] = defaultdict(list)
        for i, w in works:  # (beam 0: a Work made without decode: the model's default)
            groups[w.beam or self.model.cfg.sid.beam_width].append((i, w))
        out = {}
        for beam, group in groups.items():
            rows = torch.tensor([i for i, _ in group], device=users.device)
            excluded = [w.excluded() for _, w in group]
            seen = None
            if any(e is not None for e in excluded):  # as beam_search takes them: (ids, lengths [b])
                ex = [_NONE if e is None else e for e in excluded]
                seen = (torch.from_numpy(np.concatenate(ex)).to(users.device),
                        torch.tensor([e.size for e in ex], device=users.device))
            items, logp = head.beam_search(users.index_select(0, rows).to(dtype), beam, seen)
            items, logp = items.cpu().numpy(), logp.float().cpu().numpy()
            pos = np.minimum(np.searchsorted(self.corpus_np, items), self.corpus_np.size - 1)
            ok = (items >= 0) & np.isfinite(logp) & (self.corpus_np[pos] == items)
            for j, (i, _) in enumerate(group):
                out[i] = (items[j][ok[j]], logp[j][ok[j]])
        return out

    def merge_sources(self, works: list[tuple[int, Work]], dense: dict[int, tuple[np.ndarray, np.ndarray]],
                      generated: dict[int, tuple[np.ndarray, np.ndarray]],
                      ) -> dict[int, tuple[np.ndarray, np.ndarray] | Retrieved]:
        """Each work's retrieval from what its source(s) found (``dense``: :meth:`retrieve`'s,
        ``generated``: :meth:`generate`'s; both best first). A dense work keeps its (ids, scores)
        pair; a generative one gets the first ``retrieve_k`` of its beam, ordered by
        log-probability; "both" the deduplicated union of the dense top ``retrieve_k`` and that,
        every item keeping the scores of the sources that found it (``Retrieved``) and ordered
        by reciprocal-rank fusion: score = sum over the lists holding it of 1 / (RRF_K + rank),
        rank from 1; ties keep the dense order, then the beam's. Why fusion: the two scores are
        on different scales (a cosine logit, a log-probability) and cannot be compared; ranks
        can, and an item both sources found comes first."""
        out: dict[int, tuple[np.ndarray, np.ndarray] | Retrieved] = {}
        for i, w in works:
            if w.source == "dense":
                out[i] = dense[i]
                continue
            g_ids, g_lp = (a[: w.retrieve_k] for a in generated[i])
            if w.source == "generative":
                out[i] = Retrieved(g_ids, g_lp, np.full(g_ids.size, np.nan, np.float32), g_lp)
                continue
            d_ids, d_s = dense[i]
            ids = np.concatenate([d_ids, g_ids[~np.isin(g_ids, d_ids)]])  # dense order, then new items in beam order
            at = np.argsort(ids, kind="stable")
            g_pos = at[np.searchsorted(ids[at], g_ids)]
            d_sc, g_sc = np.full(ids.size, np.nan, np.float32), np.full(ids.size, np.nan, np.float32)
            d_sc[: d_ids.size], g_sc[g_pos] = d_s, g_lp
            fused = np.zeros(ids.size)
            fused[: d_ids.size] += 1.0 / (RRF_K + 1 + np.arange(d_ids.size))
            fused[g_pos] += 1.0 / (RRF_K + 1 + np.arange(g_ids.size))
            order = np.argsort(-fused, kind="stable")
            out[i] = Retrieved(ids[order], fused[order], d_sc[order], g_sc[order])
        return out

    def retrieve(self, users: torch.Tensor, works: Sequence[tuple[int, Asks]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Exact top-k over the whole catalogue, one matmul for all (row, work) pairs, each
        work's :meth:`Work.excluded` items masked (fewer than ``retrieve_k`` come back where
        the mask leaves fewer in the catalogue). Every engine's retrieval is this one."""
        rows = [i for i, _ in works]
        if rows != list(range(users.shape[0])):
            users = users[torch.tensor(rows, device=users.device)]
        k = max(w.retrieve_k for _, w in works)
        excluded = [w.excluded() for _, w in works]
        kernels = self.packed.kernels if self.packed is not None else None
        if self.items_native is not None and kernels is not None:  # one native call: GEMM, exclusions masked, top-k
            exclude = [_NONE if e is None else e for e in excluded]
            pos, vals = kernels.retrieve(users, self.items_native, self.corpus_np, self.model.head.cfg.temperature,
                                             exclude if any(e is not None for e in excluded) else None, k)
            return _top(self.corpus_np[pos], vals, works)
        # = model.head.scores(users, items): the same product and temperature, the items pre-transposed
        scores = torch.mm(users, self.items_t).div_(self.model.head.cfg.temperature).float()  # [b, N]
        ex = [(j, e) for j, e in enumerate(excluded) if e is not None]
        if ex:  # every work's excluded items at once: (row, catalogue position) pairs -> -inf
            seen = np.concatenate([items for _, items in ex])
            row = np.repeat([j for j, _ in ex], [items.size for _, items in ex])
            idx = np.minimum(np.searchsorted(self.corpus_np, seen), self.corpus_np.size - 1)
            hit = self.corpus_np[idx] == seen
            row, idx = torch.from_numpy(row[hit]).to(scores.device), torch.from_numpy(idx[hit]).to(scores.device)
            scores[row, idx] = -math.inf
        top = torch.topk(scores, k, dim=1)
        return _top(self.corpus_np[top.indices.cpu().numpy()], top.values.cpu().numpy(), works)

    def score(self, state, to_rank: Mapping[int, tuple[np.ndarray, ...]]) -> dict[int, np.ndarray]:  # noqa: ANN001
        """Task probabilities of every work's candidates, scored against the cached histories
        in micro-batches that mix users: {work: [c, tasks]}."""
        if not to_rank:
            return {}
        keys = list(to_rank)
        if self.packed is not None:
            return dict(zip(keys, self.packed.score(state, keys, [to_rank[i][0] for i in keys])))
        out = {i: np.zeros((0, len(self.schema.tasks)), np.float32) for i in keys}
        keys = [i for i in keys if to_rank[i][0].size]  # not those whose exclusions left nothing retrieved
        if not keys:
            return out
        items = torch.from_numpy(np.concatenate([to_rank[i][0] for i in keys])).to(self.device)
        owner = torch.from_numpy(np.concatenate([np.full(to_rank[i][0].size, i) for i in keys])).to(self.device)
        mb = self.micro_batch
        probs = torch.cat([self.model.score_candidates(state, items[s : s + mb], owner[s : s + mb])
                           for s in range(0, items.numel(), mb)]).float().cpu().numpy()
        splits = np.cumsum([to_rank[i][0].size for i in keys])[:-1]
        return out | dict(zip(keys, np.split(probs, splits)))

    def order(self, objective: str, tasks: dict[str, np.ndarray], bids: np.ndarray,
              retrieval: np.ndarray | None) -> np.ndarray:
        if objective == "retrieval" and retrieval is not None:
            return retrieval.astype(np.float64)
        if objective in tasks:
            return tasks[objective].astype(np.float64)
        # default and "ecpm": bid x product of the objective tasks (bid = 1 when none given)
        value = bids.astype(np.float64).copy()
        for t in self.objective_tasks:
            value *= tasks[t]
        return value


def _channels(got: tuple[np.ndarray, np.ndarray] | Retrieved) -> Retrieved:
    """A work's retrieval as :class:`Retrieved` (a dense (ids, scores) pair: scores are the dense ones)."""
    if isinstance(got, Retrieved):
        return got
    ids, scores = got
    return Retrieved(ids, scores, scores, None)


def _retrieved_result(got: Retrieved, w: Work) -> Result:
    """The result of a work its retrieval alone orders (Retrieve; Recommend without ranking):
    a Recommend keeps the first ``top_k`` it retrieved, as a ranked one keeps its best ``top_k``."""
    keep = slice(w.top_k) if w.kind == "recommend" else slice(None)
    gen = got.generative[keep] if got.generative is not None else None
    return Result(got.ids[keep], got.scores[keep].astype(np.float64), got.dense[keep], generative_scores=gen)


def _given(candidates: np.ndarray, w: Work) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A work's given candidates to rank: (table rows, ids to return, bids; 1 where none came)."""
    ids = w.candidate_ids if w.candidate_ids is not None else candidates
    return candidates, ids, w.bids if w.bids is not None else np.ones(candidates.size)


def _ranked_result(w: Work, out_ids: np.ndarray, value: np.ndarray, tasks: dict[str, np.ndarray],
                   got: Retrieved | None) -> Result:
    """The result of a ranked work: its items ordered by ``value`` [c] (a Recommend's best
    ``top_k``, a Rank's all), with their task probabilities and retrieval scores (``got``)."""
    keep = np.argsort(-value, kind="stable")[: w.top_k] if w.kind == "recommend" else np.arange(value.size)
    return Result(out_ids[keep], value[keep], got.dense[keep] if got else None, {t: v[keep] for t, v in tasks.items()},
                  generative_scores=got.generative[keep] if got and got.generative is not None else None)


def _top(ids: np.ndarray, vals: np.ndarray, works: Sequence[tuple[int, Asks]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{work: (ids, scores)}: row j's first ``retrieve_k`` of ids / vals [b, k] (best first),
    masked ones (-inf: excluded, sorted last) left out."""
    out = {}
    for j, (i, w) in enumerate(works):
        d, v = ids[j, : w.retrieve_k], vals[j, : w.retrieve_k]
        keep = v > -math.inf
        out[i] = (d, v) if keep.all() else (d[keep], v[keep])
    return out


def native_ok(model: GenerativeRecommender) -> bool:
    """Whether the native path computes this model here (the packed path covers it, the
    tower's native backend does, and the library builds)."""
    return packed_supports(model) and model.tower.native_supported()


def version_of(manifest: Manifest) -> str:
    src = manifest.source
    run = Path(src.get("run_dir", "?")).name
    return f"{run}/{src.get('checkpoint', '?')}/{manifest.quantization.get('embeddings')}-{manifest.quantization.get('dense')}"


class NaiveTorchEngine(TorchEngine):
    """The baseline: one request at a time, eager, no shared history encoding.

    Retrieval encodes the history; ranking appends the candidates to the history and runs
    the whole tower again (``model.rank``). Same model, same scores, none of the serving
    work: what a first deployment would do. Serve it with ``--serve.batch.max_batch=1``.
    """

    name = "naive"

    def __init__(self, artifact: str | Path, device: str = "cpu", **kwargs) -> None:  # noqa: ANN003
        super().__init__(artifact, device, padded=False, **kwargs)  # eager, the model's own path

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        return self.account(works, [self._one(w) for w in works], None, None)

    def _one(self, w: Work) -> Result:
        t0 = time.perf_counter()
        batch = collate_users([w.user], self.model, self.device, window_block=self.window_block)
        users = self.model.user_embeddings(batch)
        retrieves = w.kind == "retrieve" or w.candidates is None
        got = _channels(self.retrieve_sources(users, [(0, w)])[0]) if retrieves else None
        if got is not None and (w.kind == "retrieve" or not self.schema.tasks or w.objective == "retrieval"):
            result = _retrieved_result(got, w)
            result.compute_ms = (time.perf_counter() - t0) * 1e3
            return result
        if w.candidates is not None:
            cands, out_ids, bids = _given(w.candidates, w)
        elif got is not None:
            cands = out_ids = got.ids
            bids = np.ones(cands.size)
        batch = collate_users([w.user], self.model, self.device, candidates=[cands], window_block=self.window_block)
        probs = self.model.rank(batch).float().cpu().numpy()
        tasks = {t: probs[:, j] for j, t in enumerate(self.schema.tasks)}
        result = _ranked_result(w, out_ids, self.order(w.objective, tasks, bids, got.scores if got else None), tasks, got)
        result.compute_ms = (time.perf_counter() - t0) * 1e3
        return result
