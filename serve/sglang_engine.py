"""The SGLang engine: users' encoded histories live in SGLang's KV pool and radix cache.

The only module of serve/ that imports SGLang. What happens where:

    this process (SGLangEngine)                SGLang's scheduler process (GenRecHSTU)
    ----------------------------------------   --------------------------------------------
    validate; each work's history window       the radix cache matches the longest cached
    -> one token id per event (a hash of         prefix of the user's tokens (extra key =
       item, action, its time, the next          user id); only the rest is prefilled, in
       event's time) + the events and the        chunks, with the batch's other requests
       work as the request's custom params     per new token: the artifact's (quantized)
       (one request per work, all in flight)     lookups, then each HSTU layer writes its
                                                 K/V to the pool (slot time beside it) and
                                                 attends over the request's slots
                                               at a request's last token: its user vector,
                                                 retrieval (exact top-k, exclusions), and
                                                 the candidates (given or retrieved) scored
                                                 against the history's K/V in the pool
    order by the objective                  <- retrieved positions and scores, task
                                                 probabilities: one float row per request

Why the ids mean "the same history": token j's keys and values depend on events 0..j and on
its query time (the next event's time; the last event's is the request time), all of which
its id and its place in the radix path pin down. SGLang always prefills a request's last
token, so the last event (queried at the request time) is recomputed on every call and its
row gives the user vector. Candidates never enter the pool: they are scored in the same
forward against the history's pooled keys / values (each sees the history and itself), so
they cost no pool slots and cannot be matched by a later call.

Generative retrieval (a model with a semantic-ID decoder; ``serve/sglang_models/sid_steps.py``):
a work whose source is generative (or both) also sends a *beam*: a one-token request (its
ticket) decoded by SGLang's built-in beam search (``beam_width``, ``max_new_tokens`` = levels
+ 1) over a vocabulary of trie nodes, so that each level's logits, computed by the model, are
finite only at the prefix's children: every beam ends on a real item. SGLang drops a beam
request's custom params, so the beam's prompt (the user vector, computed by the work's tower
request in the same batch) and its exclusions wait in the model under the ticket; a beam
scheduled ahead of its tower request answers "retry" and is sent again. The decoder's few
tokens are recomputed at each step (no K/V of theirs in the pool); the model ends each beam
itself at the last level (SGLang's selection would renormalise over the excluded items) and
returns its items and log-probabilities as customized info. A work that ranks what its beam
found ranks it in a second call (the history cached). Choice and figures:
benchmarks/notes/2026-12-03-sid-sglang.md.

Custom params are SGLang's per-request payload for custom logit processors (a no-op one is
attached so they reach the forward batch); they carry the events the model embeds itself
(no per-token float rows through IPC). The model owns its attention: SGLang's attention
backend and ``RadixAttention`` are not used; the pool is shaped to the tower (layers, heads,
qk and v dims) and read through the request-to-token map.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
from safetensors.torch import save_file
from torch import nn

from genrec.serve import sglang_shim

log = logging.getLogger("genrec.serve.sglang")
PAYLOAD = "genrec"  # the custom params' key
_START_LOCK = threading.Lock()  # one engine starts at a time: each knows its own processes


def _prepare_environment() -> None:
    """Before SGLang is imported: CPU engine switch, our model package, the shims (here and
    in SGLang's spawned workers, through PYTHONPATH)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "genrec.serve.sglang_models"
    paths = [sglang_shim.HERE]  # (genrec itself is installed: the workers import it as we do)
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in current if p not in paths])
    sglang_shim.install()


_prepare_environment()

import sglang as sgl  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool  # noqa: E402
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor  # noqa: E402

from genrec.models.hstu import CachedHistory, JaggedMeta, PagedMeta  # noqa: E402
from genrec.models.recommender import HistoryState  # noqa: E402
from genrec.serve.accounting import mark, stamp  # noqa: E402
from genrec.serve.catalogue import read_served  # noqa: E402
from genrec.serve.contract import InProcessEngine, Result  # noqa: E402
from genrec.serve.engine import TorchEngine  # noqa: E402
from genrec.serve.layout import pack_users  # noqa: E402
from genrec.serve.packed import packed_covers  # noqa: E402
from genrec.serve.ranking import Ranking  # noqa: E402
from genrec.serve.requests import UserInput, Work  # noqa: E402
from genrec.serve.retrieval import merge_sources  # noqa: E402
from genrec.serve.sglang_models.sid_steps import SIDBeams, SIDSteps, SIDVocab  # noqa: E402

VOCAB = 4  # the dummy logits' width of a model without a semantic-ID decoder (nothing is decoded)
TICKET_BASE = 1 << 62  # a beam's one prompt token: TICKET_BASE + its ticket (never a trie node id)
SID_INFO = "genrec_sid"  # the customized-info key of a beam's result
_EMPTY = torch.zeros(3)  # the row of a request this pass does not finish (a chunk of it)
_MASK63 = np.uint64((1 << 63) - 1)


def event_token_ids(items: np.ndarray, actions: np.ndarray, times: np.ndarray, query_times: np.ndarray) -> np.ndarray:
    """[n] int64 token ids (63-bit hashes) of events: equal ids <=> equal (item, action,
    time, query time), up to hash collisions (about 2^-63 per compared pair)."""
    with np.errstate(over="ignore"):
        h = np.zeros(items.shape, np.uint64)
        for col, mult in ((items, 0x9E3779B97F4A7C15), (actions, 0xC2B2AE3D27D4EB4F), (times, 0x165667B19E3779F9),
                          (query_times, 0xD6E8FEB86659FD93)):
            h = (h ^ col.astype(np.int64).view(np.uint64)) * np.uint64(mult)
            h ^= h >> np.uint64(29)
        h ^= h >> np.uint64(32)
    return (h & _MASK63).astype(np.int64)


class KeepLogits(CustomLogitProcessor):
    """A no-op custom logit processor: attached to every request so that SGLang hands the
    requests' custom params (our payload) to the forward batch."""

    def __call__(self, logits, custom_param_list=None):  # noqa: ANN001, ANN204
        return logits


class _Retrieval:
    """What ``Catalogue.top_k`` reads of a work: k and the excluded rows (``catalogue.Asks``)."""

    def __init__(self, k: int, excluded: np.ndarray | None) -> None:
        self.retrieve_k, self._excluded = k, excluded

    def excluded(self) -> np.ndarray | None:
        return self._excluded


@dataclass
class _Part:
    """The requests of one extend pass that the tower computes (those with genrec's payload):
    their rows in the batch, payloads, cached and new tokens, the new tokens' positions and
    pool slots [T], and their req-to-token rows [b]."""

    index: list[int]
    payloads: list[dict]
    pre: list[int]
    ext: list[int]
    positions: torch.Tensor
    loc: torch.Tensor
    pool_rows: torch.Tensor


class GenRecHSTU(nn.Module):
    """SGLang model (EntryClass): a genrec artifact's HSTU model over SGLang's KV pool.

    ``config.genrec_artifact`` names the artifact; the model loads it itself (its quantized
    tables, tower and heads) through a ``TorchEngine`` whose lookups, retrieval and ranking
    it reuses. Each forward returns one float row per request (``hidden_states``, capture
    mode "last"): [n retrieved, n scored, tokens this pass computed for it, retrieved catalogue
    positions, their scores, task probabilities (n scored x tasks)], zeros for a chunk that
    does not end its request.

    With a semantic-ID decoder (``config.genrec_max_beam`` > 0) it also decodes beams with
    SGLang's beam search (``SIDSteps``): a beam's request is one ticket token whose prompt a
    tower request registered (payload ``ticket``) or a register request brought (payload
    ``register``); its result comes back as customized info ``genrec_sid`` at its last level.
    """

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:  # noqa: ANN001
        super().__init__()
        torch.set_num_threads(int(getattr(config, "genrec_threads", 1)) or torch.get_num_threads())
        self.engine = TorchEngine(config.genrec_artifact)
        self.model = self.engine.model.eval()
        packed = self.engine.packed  # its token lookups and context (SGLangEngine checked it exists)
        if packed is None:
            raise ValueError("GenRecHSTU serves HSTU models with the summed action encoding (the packed path)")
        self.packed = packed
        self.tasks = len(self.engine.schema.tasks)
        self.slot_times: torch.Tensor | None = None  # [pool slots] each slot's event time
        max_beam = int(getattr(config, "genrec_max_beam", 0))
        head = self.model.sid_head
        steps = SIDSteps(head, max_beam) if head is not None and max_beam else None
        self.vocab = steps.size if steps is not None else VOCAB
        self.sid = SIDBeams(steps, self.model.embedding_cfg.dim) if steps is not None else None
        self.slot_ticket: torch.Tensor | None = None  # [pool slots] the ticket of a beam's prompt token
        self._dummy = nn.Parameter(torch.zeros(1), requires_grad=False)  # SGLang loads one weight file

    def get_input_embeddings(self) -> nn.Module:
        return nn.Identity()

    def load_weights(self, weights) -> None:  # noqa: ANN001
        for name, _ in weights:  # the artifact is loaded in __init__; the checkpoint holds a placeholder
            if name != "_dummy":
                raise KeyError(f"GenRecHSTU: unexpected weight {name}")

    # ----- the forward pass over one SGLang batch ----------------------------------------
    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False, **kw):  # noqa: ANN001, ANN201
        fb = forward_batch
        b = fb.batch_size
        if fb.forward_mode.is_decode() and self.sid is not None:  # only beams decode
            return self._decode(input_ids, positions, fb)
        rows = [_EMPTY] * b  # one row per request; padded to the batch's longest
        logits = torch.zeros(b, self.vocab)
        if not fb.forward_mode.is_extend():
            return LogitsProcessorOutput(next_token_logits=logits, hidden_states=_stack(rows))
        params = fb.sampling_info.custom_params if fb.sampling_info is not None else None
        payloads = [p.get(PAYLOAD) if isinstance(p, dict) else None for p in (params or [None] * b)]
        pre, ext = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        for p in payloads:
            if p is not None and "register" in p:
                self._keep(p["register"], torch.tensor(p["register"]["prompt"], dtype=torch.float32))
        tower = [i for i, p in enumerate(payloads) if p is not None and "items" in p]
        beams = [i for i, p in enumerate(payloads) if p is None]
        if beams and self.sid is None:
            log.error("GenRecHSTU: a request without genrec's payload; send requests through SGLangEngine")
            beams = []
        if tower:
            part = self._part(fb, tower, payloads, pre, ext, positions)
            h, kv = self._extend(part)
            done = [j for j in range(len(tower)) if part.pre[j] + part.ext[j] == len(part.payloads[j]["items"])]
            if done:
                self._finish(part, done, h, kv, rows)
        info = None
        if beams and self.sid is not None:  # after the tower: a beam may read a prompt its tower request registered
            last = torch.as_tensor(np.cumsum(ext) - 1)[beams]
            tokens, levels = input_ids[last].to(torch.int64), positions[last].to(torch.int64)
            tickets = tokens - TICKET_BASE
            self._ticket_slots()[fb.out_cache_loc[last].to(torch.int64)] = tickets
            out, results = self.sid.step(tickets, tokens, levels)
            logits[torch.tensor(beams)] = out
            info = {SID_INFO: [results.get(beams.index(i)) if i in beams else None for i in range(b)]}
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=_stack(rows), customized_info=info)

    # ----- semantic-ID beams -------------------------------------------------------------
    def _keep(self, p: dict, prompt: torch.Tensor) -> None:
        """A beam's prompt [D] and what it leaves out, from a payload's ``ticket``, ``beam``, ``seen``."""
        if self.sid is not None:
            seen = None if p["seen"] is None else np.asarray(p["seen"], np.int64)
            self.sid.keep(int(p["ticket"]), prompt, int(p["beam"]), seen)

    def _ticket_slots(self) -> torch.Tensor:
        pool = get_token_to_kv_pool()
        if self.slot_ticket is None or self.slot_ticket.numel() < pool.size + pool.page_size:
            self.slot_ticket = torch.full((pool.size + pool.page_size,), -1, dtype=torch.int64)
        return self.slot_ticket

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> LogitsProcessorOutput:  # noqa: ANN001
        """One step of every beam in the batch (leaders and SGLang's member rows alike): a row's
        ticket is its prompt token's (position 0 of its req-to-token row), its level its position."""
        r2t = get_req_to_token_pool().req_to_token
        prompt_slots = r2t[fb.req_pool_indices.to(torch.int64), 0].to(torch.int64)
        tickets = self._ticket_slots()[prompt_slots]
        if self.sid is None:
            raise ValueError("GenRecHSTU: a decode step, but this model has no semantic-ID decoder")
        out, results = self.sid.step(tickets, input_ids.to(torch.int64), positions.to(torch.int64))
        info = {SID_INFO: [results.get(i) for i in range(out.shape[0])]}
        return LogitsProcessorOutput(next_token_logits=out, hidden_states=None, customized_info=info)

    # ----- the tower ---------------------------------------------------------------------
    def _part(self, fb, index: list[int], payloads: list, pre: list[int], ext: list[int],  # noqa: ANN001
              positions: torch.Tensor) -> _Part:
        """The tower's requests of this pass (all of them unless beams ride along)."""
        loc, pool_rows = fb.out_cache_loc.to(torch.int64), fb.req_pool_indices.to(torch.int64)
        pos = positions.to(torch.int64)
        if len(index) < len(pre):
            starts = np.cumsum(ext) - ext
            tok = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i] + ext[i]) for i in index]))
            loc, pos, pool_rows = loc[tok], pos[tok], pool_rows[torch.tensor(index)]
        return _Part(index, [payloads[i] for i in index], [pre[i] for i in index], [ext[i] for i in index],
                     pos, loc, pool_rows)

    def _extend(self, part: _Part):  # noqa: ANN202
        """The part's new tokens through the tower over the pool -> (their outputs [T, D],
        (slot map [B, L], the pool, each request's tokens after this pass [B]))."""
        m, payloads, pre, ext = self.model, part.payloads, part.pre, part.ext
        cols = {key: np.concatenate([np.asarray(p[key][s : s + e], np.int64) for p, s, e in zip(payloads, pre, ext)])
                for key in ("items", "actions", "times", "qtimes")}
        pos = part.positions
        x = self.packed.tokens(cols["items"], cols["actions"], pos.numpy())
        pool, r2t = get_token_to_kv_pool(), get_req_to_token_pool().req_to_token
        if self.slot_times is None or self.slot_times.numel() < pool.size + pool.page_size:
            self.slot_times = torch.zeros(pool.size + pool.page_size, dtype=torch.int64)
        loc = part.loc
        self.slot_times[loc] = torch.from_numpy(cols["times"])
        lengths = torch.tensor([s + e for s, e in zip(pre, ext)], dtype=torch.int64)
        slots = r2t[part.pool_rows, : int(lengths.max())].to(torch.int64)  # [B, L]
        seq = torch.repeat_interleave(torch.arange(len(pre)), torch.tensor(ext))

        def store(layer: int, kk: torch.Tensor, vv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            kb, vb = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            kb[loc], vb[loc] = kk.to(kb.dtype), vv.to(vb.dtype)
            return kb[slots], vb[slots]

        if not any(pre) and self.packed.backend == "native":
            return self._encode_native(x, cols, ext, loc, pool), (slots, pool, lengths)
        meta = PagedMeta(seq, pos, lengths, self.slot_times[slots] if m.tower.time_bias else None,
                         torch.from_numpy(cols["qtimes"]) if m.tower.time_bias else None)
        return m.tower.extend_paged(x, meta, store), (slots, pool, lengths)

    def _encode_native(self, x: torch.Tensor, cols: dict, ext: list[int], loc: torch.Tensor, pool) -> torch.Tensor:  # noqa: ANN001
        """A batch of requests none of which has a cached prefix (new users, first chunks):
        the tower's C++ encode of the whole batch (as the torch engine encodes a cold batch),
        its keys / values written to the requests' slots. Returns outputs [T, D] of which
        only each request's last row is set (the only one read)."""
        m = self.model
        offsets = torch.zeros(len(ext) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(ext), 0)
        times = (torch.from_numpy(cols["times"]), torch.from_numpy(cols["qtimes"])) if m.tower.time_bias else (None, None)
        meta = JaggedMeta(offsets, max(ext), times[0], times[1], None)
        last, hist = m.tower.encode_history(x, meta, backend="native")
        c = m.tower.kv_dims()
        for i, (k, v) in enumerate(zip(hist.native.k, hist.native.v)):
            kb, vb = pool.get_key_buffer(i), pool.get_value_buffer(i)
            kb[loc] = k.view(-1, c.heads, c.key_dim).to(kb.dtype)
            vb[loc] = v.view(-1, c.heads, c.value_dim).to(vb.dtype)
        h = x.new_zeros(x.shape[0], last.shape[1])
        h[offsets[1:] - 1] = last.to(h.dtype)
        return h

    def _finish(self, part: _Part, done: list[int], h: torch.Tensor, kv, rows: list[torch.Tensor]) -> None:  # noqa: ANN001
        """The part's requests whose last token was in this pass (``done``: their places in the
        part): retrieval and ranking, into ``rows``; the prompts of the beams they asked for."""
        eng, m, payloads, ext = self.engine, self.model, part.payloads, part.ext
        slots, pool, lengths = kv
        ends = np.cumsum(ext) - 1
        users = m.head.normalize(h[torch.as_tensor(ends[done])].float())  # [d, D]
        for j, i in enumerate(done):
            if payloads[i].get("ticket") is not None:  # the prompt of this user's beam (sent beside it)
                self._keep(payloads[i], users[j].clone())
        # the requests' histories as the candidates' extend reads them: jagged K/V from the pool
        flat = torch.cat([slots[i, : int(lengths[i])] for i in done])
        offsets = torch.zeros(len(done) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths[done], 0)
        c = m.tower.kv_dims()
        layers = [(pool.get_key_buffer(i)[flat].to(users.dtype).view(-1, c.heads, c.key_dim),
                   pool.get_value_buffer(i)[flat].to(users.dtype).view(-1, c.heads, c.value_dim))
                  for i in range(c.layers)]
        request = torch.tensor([payloads[i]["qtimes"][-1] for i in done], dtype=torch.int64)
        times = self.slot_times[flat] if m.tower.time_bias and self.slot_times is not None else None
        none = np.zeros(0, np.int64)
        ctx = self.packed.context([UserInput(none, none, none, True, 0, {n: np.asarray(v, np.int64) for n, v in
                                                                         payloads[i]["context"].items()}) for i in done])
        state = HistoryState(CachedHistory(layers, offsets, times, request if m.tower.time_bias else None),
                             lengths[done].clone(), ctx)
        need = [(j, _Retrieval(payloads[i]["k"], _array(payloads[i]["excluded"])))
                for j, i in enumerate(done) if payloads[i]["k"]]
        found = eng.catalogue.top_k(users, need) if need else {}
        to_rank = {}
        for j, i in enumerate(done):
            p = payloads[i]
            if p["rank"] == "given":
                to_rank[j] = (np.asarray(p["candidates"], np.int64),)
            elif p["rank"] == "retrieved":
                to_rank[j] = (found[j][0],)
        probs = eng.score(state, to_rank) if to_rank else {}
        for j, i in enumerate(done):
            ids, scores = found.get(j, (np.zeros(0, np.int64), np.zeros(0, np.float32)))
            pr = probs.get(j, np.zeros((0, self.tasks), np.float32))
            pos = np.searchsorted(eng.corpus_np, ids)  # catalogue positions: exact in fp32 below 2^24
            rows[part.index[i]] = torch.from_numpy(np.concatenate([[ids.size, pr.shape[0], ext[i]], pos, scores,
                                                       pr.reshape(-1)]).astype(np.float32))


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, longest row] (the output rows, zero-padded: each row's header says what it holds)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if rows else torch.zeros(0, 3)


def _array(values: list | None) -> np.ndarray | None:
    return None if values is None else np.asarray(values, np.int64)


@dataclass
class _Req:
    """One SGLang request: token ids, genrec's payload (None: a semantic-ID beam), the radix
    cache's extra key, and a beam's width."""

    ids: list[int]
    payload: dict | None
    key: str
    beam: int = 0


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
    source is generative or both): ``max_beam``: the widest beam (the vocabulary carries
    2 x max_beam padding ids); ``beam_rows``: req-to-token rows added for the beams in flight
    (a beam of k holds k)."""

    name = "sglang"
    batches_together = True  # the batches in flight merge in SGLang's scheduler (serve.batcher admission)

    def __init__(self, artifact: str | Path, device: str = "cpu", pool_tokens: int = 262144, window_block: int = 1,
                 chunk_tokens: int = 4096, max_running: int = 64, threads: int = 1, max_beam: int = 256,
                 beam_rows: int = 1024) -> None:
        served = read_served(artifact)
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
        self._stats = {"hits": 0, "misses": 0, "history_tokens": 0, "cached_tokens": 0}
        self._lock = threading.Lock()
        # the semantic-ID decoder's beams: SGLang's beam search over trie-node tokens (SIDSteps)
        self.sid = SIDVocab(served.sid, max_beam) if served.sid is not None else None
        self.max_beam = max_beam if self.sid is not None else 0
        self._tickets = itertools.count(1)
        self.closed = False
        if self.sid is not None:  # a beam holds one req-to-token row per live sequence
            max_running += beam_rows
        self.ckpt = Path(tempfile.mkdtemp(prefix="genrec-sglang-"))
        cfg = {"architectures": ["GenRecHSTU"], "model_type": "llama", "hidden_size": served.embedding.dim,
               "num_attention_heads": c.heads, "num_key_value_heads": c.heads, "head_dim": c.key_dim,
               "v_head_dim": c.value_dim, "num_hidden_layers": c.layers, "intermediate_size": 1,
               "vocab_size": self.sid.size if self.sid is not None else VOCAB,
               "max_position_embeddings": served.model.max_seq_len + 16,  # SGLang keeps a few positions back
               "torch_dtype": "float32", "genrec_artifact": str(Path(artifact).resolve()), "genrec_threads": threads,
               "genrec_max_beam": self.max_beam}
        (self.ckpt / "config.json").write_text(json.dumps(cfg))
        save_file({"_dummy": torch.zeros(1)}, str(self.ckpt / "model.safetensors"))
        self.processor = KeepLogits.to_str()
        # SGLang's Engine and its client tasks live on one asyncio loop, on a thread of its own;
        # run() submits to it from any thread, so several batches are in flight at once.
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self.thread.start()
        self.engine = asyncio.run_coroutine_threadsafe(
            self._start(device, pool_tokens, chunk_tokens, max_running), self.loop).result()

    async def _start(self, device: str, pool_tokens: int, chunk: int, max_running: int):  # noqa: ANN202
        # the processes this engine starts are the ones close() stops (SGLang's own shutdown
        # kills every child process of ours: another engine's, an engine worker's)
        with _START_LOCK:
            before = {p.pid for p in psutil.Process().children(recursive=True)}
            engine = self._engine(device, pool_tokens, chunk, max_running)
            self.procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        return engine

    def _engine(self, device: str, pool_tokens: int, chunk: int, max_running: int):  # noqa: ANN202
        return sgl.Engine(model_path=str(self.ckpt), device=device, dtype="float32", skip_tokenizer_init=True,
                          attention_backend="torch_native", disable_cuda_graph=True, chunked_prefill_size=chunk,
                          max_prefill_tokens=chunk, max_total_tokens=pool_tokens, max_running_requests=max_running,
                          mem_fraction_static=0.3, enable_custom_logit_processor=True,
                          return_hidden_states_mode="last", sleep_on_idle=True, log_level="warning")

    def close(self) -> None:
        """Stops SGLang's processes and the loop its client tasks live on."""
        if self.closed:
            return
        self.closed = True

        async def stop() -> None:
            watchdog = getattr(self.engine.tokenizer_manager, "_subprocess_watchdog", None)
            if watchdog is not None:  # it would signal this process when our scheduler exits
                watchdog.stop()
            for p in self.procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.terminate()
            _, alive = psutil.wait_procs(self.procs, timeout=10)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        super().close()  # the threads run_async hands batches to

    def cache_stats(self) -> dict:
        """Counters since start: calls that reused cached tokens (hits) or none (misses),
        history tokens and how many of them came from the radix cache; the pool's capacity.
        (SGLang's radix cache does not report its evictions or use to the client.)"""
        with self._lock:
            out = dict(self._stats)
        out.update(capacity_tokens=self.pool_tokens, bytes_per_token=self.bytes_per_token)
        return out

    # ----- requests: one tower request per work, one beam per generative retrieval ----------
    def _request(self, w: Work, ticket: int | None = None, candidates: np.ndarray | None = None) -> _Req:
        """A work's tower request: its history as token ids, the payload, its user's key.
        ``ticket``: the request also registers the prompt of the work's beam (its user vector,
        computed here) and what the beam leaves out; ``candidates``: it ranks these instead (the
        second call of a work that ranks what its beam found)."""
        items, actions, tk, tq, _, _ = pack_users([w.user], self.cap, self.has_action, self.window_block)
        ids = event_token_ids(items, actions, tk, tq).tolist()
        retrieve = (w.kind == "retrieve" or w.candidates is None) and candidates is None
        dense = retrieve and w.source != "generative"
        # what Ranking.plan will rank (a model without tasks has nothing to score: run() fills zeros);
        # a work whose candidates come from its beam ranks them in a second call
        none = np.zeros(0, np.int64)
        ranks = candidates is not None or (
            bool(self.schema.tasks) and 0 in self.ranking.plan([w], {0: (none, none)} if retrieve else {}))
        given = candidates if candidates is not None else (None if retrieve else w.candidates)
        rank = "none" if not ranks or (retrieve and w.source != "dense") else ("retrieved" if retrieve else "given")
        excluded = w.excluded() if retrieve else None
        payload = {"items": items.tolist(), "actions": actions.tolist(), "times": tk.tolist(), "qtimes": tq.tolist(),
                   "k": int(w.retrieve_k) if dense else 0,
                   "excluded": None if excluded is None or not dense else excluded.tolist(),
                   "rank": rank, "candidates": given.tolist() if rank == "given" and given is not None else None,
                   "context": {k: v.tolist() for k, v in w.user.context.items()},
                   "ticket": ticket, "beam": self._beam_of(w) if ticket is not None else 0,
                   "seen": None if excluded is None or ticket is None else excluded.tolist()}
        # a user's entries are matched only against its own; no id: a key of its own, shared with nobody
        key = f"u:{w.user.user_id}" if w.user.user_id else f"anon:{uuid.uuid4().hex}"
        return _Req(ids, payload, key)

    def _beam_of(self, w: Work) -> int:
        beam = w.beam or self.schema.beam_width
        if not 1 <= beam <= self.max_beam:
            raise ValueError(f"beam {beam}: this SGLang engine decodes beams of 1 to {self.max_beam} "
                             f"(SGLangEngine(max_beam=...); serve.limits.max_beam)")
        return beam

    def _beam(self, ticket: int, beam: int) -> _Req:
        """A beam's request: one token naming its ticket (its own key: never shared)."""
        return _Req([TICKET_BASE + ticket], None, f"sid:{ticket}", beam)

    def _params(self, r: _Req) -> dict:
        if r.payload is not None or self.sid is None:  # (a beam only where there is a decoder)
            return {"max_new_tokens": 1, "custom_params": {PAYLOAD: r.payload}}
        if r.beam == 1:  # greedy decoding (SGLang's beam search needs two)
            return {"max_new_tokens": self.sid.levels, "ignore_eos": True, "temperature": 0.0}
        # one step past the last level: SGLang hands a beam's leader the customized info of the
        # steps that added to its output, and its final step adds nothing (the model answers at
        # the last level; the extra step's rows are past the trie: padding only)
        return {"max_new_tokens": self.sid.levels + 1, "ignore_eos": True, "beam_width": r.beam}

    async def _generate(self, reqs: list[_Req]) -> list[dict]:
        obj = GenerateReqInput(
            input_ids=[r.ids for r in reqs], sampling_params=[self._params(r) for r in reqs],
            custom_logit_processor=[self.processor if r.payload is not None else None for r in reqs],
            return_hidden_states=["last" if r.payload is not None else False for r in reqs],
            extra_key=[r.key for r in reqs])
        out = await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()
        return out if isinstance(out, list) else [out]

    def _call(self, reqs: list[_Req], beams: dict[int, tuple[int, int]]) -> tuple[list[dict], dict]:
        """Sends ``reqs`` and the ``beams`` ({work: (ticket, width)}, after them) in one batch ->
        (the requests' outputs, {work: (item ids, log-probabilities)}). A beam that ran before the
        request registering its prompt (SGLang may schedule them apart) is sent again: by then
        the prompt is there."""
        todo = list(beams)
        outs = asyncio.run_coroutine_threadsafe(self._generate(reqs + [self._beam(*beams[i]) for i in todo]),
                                                self.loop).result()
        outs, got = outs[: len(reqs)], dict(zip(todo, outs[len(reqs):]))
        found = {}
        for attempt in range(2):
            for i, o in got.items():
                res = next((v for v in reversed(o["meta_info"].get(SID_INFO) or []) if isinstance(v, dict)), None)
                if res is not None and "retry" not in res:
                    found[i] = self._items(res)
            todo = [i for i in beams if i not in found]
            if not todo or attempt:
                break
            again = asyncio.run_coroutine_threadsafe(self._generate([self._beam(*beams[i]) for i in todo]),
                                                     self.loop).result()
            got = dict(zip(todo, again))
        if todo:
            raise RuntimeError(f"SGLang ended {len(todo)} semantic-ID beams without a result")
        return outs, found

    def _items(self, res: dict) -> tuple[np.ndarray, np.ndarray]:
        """A beam's result -> (item ids, log-probabilities), items outside the catalogue left out."""
        items, logp = np.asarray(res["items"], np.int64), np.asarray(res["scores"], np.float32)
        pos = np.minimum(np.searchsorted(self.corpus_np, items), self.corpus_np.size - 1)
        ok = self.corpus_np[pos] == items
        return items[ok], logp[ok]

    def generate(self, users: torch.Tensor, works: list[tuple[int, Work]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """TorchEngine.generate's answers, decoded by SGLang: each work's prompt (row i of
        ``users`` [B, D]) goes to the model in a register request, its beam right after it."""
        if self.sid is None:
            raise ValueError("this model has no semantic-ID decoder (model.sid)")
        reqs, beams = [], {}
        for i, w in works:
            beams[i] = (next(self._tickets), self._beam_of(w))
            seen = w.excluded()
            reg = {"ticket": beams[i][0], "beam": beams[i][1], "prompt": users[i].float().tolist(),
                   "seen": None if seen is None else seen.tolist()}
            reqs.append(_Req([0], {"register": reg}, f"sid:{beams[i][0]}:prompt"))
        return self._call(reqs, beams)[1]

    def _row(self, o: dict) -> np.ndarray:
        hs = o["meta_info"]["hidden_states"]  # the "last" row (a list of rows on some paths: the last)
        return np.asarray(hs[-1] if hs and isinstance(hs[0], list) else hs, np.float32)

    def _probs(self, row: np.ndarray) -> np.ndarray:
        n_ret, n_prob, tasks = int(row[0]), int(row[1]), len(self.schema.tasks)
        return row[3 + 2 * n_ret : 3 + 2 * n_ret + n_prob * tasks].reshape(n_prob, tasks)

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        t0 = time.perf_counter()
        retrieving = [(i, w) for i, w in enumerate(works) if w.kind == "retrieve" or w.candidates is None]
        beams = {i: (next(self._tickets), self._beam_of(w)) for i, w in retrieving if w.source != "dense"}
        reqs = [self._request(w, beams[i][0] if i in beams else None) for i, w in enumerate(works)]
        outs, generated = self._call(reqs, beams)
        dense, probs, computed = {}, {}, {}
        tasks = len(self.schema.tasks)
        hist = cached = hits = 0
        for i, (o, r) in enumerate(zip(outs, reqs)):
            row, p = self._row(o), r.payload or {}  # (every tower request has its payload)
            n_ret, computed[i] = int(row[0]), int(row[2])
            if n_ret or p.get("k"):
                dense[i] = (self.corpus_np[row[3 : 3 + n_ret].astype(np.int64)], row[3 + n_ret : 3 + 2 * n_ret].copy())
            if p.get("rank", "none") != "none":
                probs[i] = self._probs(row)
            n, c = len(r.ids), int(o["meta_info"].get("cached_tokens", 0))
            hist, cached, hits = hist + n, cached + c, hits + (c > 0)
        with self._lock:
            s = self._stats
            s["hits"] += hits
            s["misses"] += len(works) - hits
            s["history_tokens"] += hist
            s["cached_tokens"] += cached
        retrieved = merge_sources(retrieving, dense, generated) if beams else dense
        to_rank = self.ranking.plan(works, retrieved)
        later = [i for i in to_rank if i in beams]  # ranks what its beam found: a second call, history cached
        if later:
            second = self._call([self._request(works[i], candidates=to_rank[i][0]) for i in later], {})[0]
            probs.update({i: self._probs(self._row(o)) for i, o in zip(later, second)})
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
