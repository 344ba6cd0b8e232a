"""The scheduler side of the SGLang engine: genrec's HSTU model as an SGLang model (EntryClass).

SGLang loads this module in its scheduler process (``SGLANG_EXTERNAL_MODEL_PACKAGE`` names this
package; ``config.json``'s ``architectures`` names :class:`GenRecHSTU`). The front end,
``serve.sglang_engine.SGLangEngine``, sends one request per work whose payload (custom params)
carries the events; this model embeds them, writes each HSTU layer's keys and values to SGLang's
KV pool, attends over the request's slots and, at a request's last token, retrieves and ranks.
Each request's answer is one row of ``codec`` (the two sides' shared format).

Generative retrieval runs in the same forward: a work whose source is the semantic-ID decoder
(or both) has its beam decoded right after its user vector, by the torch engine's own
``serve.retrieval.generate`` (``SIDDecoder.beam_search``, the reference itself), its items
fused with the dense top-k (``merge_sources``) and ranked there when the work ranks: one SGLang
request per work. A request with a ``prompt`` (``SGLangEngine.generate``: a given user vector)
decodes that vector's beam alone. Why not SGLang's built-in beam search (the design before
2026-12-05): it paid one scheduler round per code level plus one, which made a beam of 50 ~10x
the reference on this CPU (benchmarks/notes/2026-12-05-sid-sglang-fast.md).

A fault in the forward stays inside it: the model catches an exception of its tower pass, runs
the pass's requests again one at a time, and answers the one at fault with a failed row and its
reason (customized info ``codec.ERROR_INFO``); an exception that reached SGLang's scheduler would
end the scheduler and signal the engine's process (SIGQUIT). The front end fails such a call
(INTERNAL, naming the reason) and stops matching its user's cached entries (whose K/V the failed
pass may have half written).

The SGLang surfaces it uses (listed in docs/serving.md, checked by tests/test_sglang_surfaces.py):
``LogitsProcessorOutput`` (next-token logits, "last" hidden states, customized info), the forward
batch's fields (forward mode, batch size, out_cache_loc, req_pool_indices, extend prefix / seq
lengths, sampling_info.custom_params), ``forward_context``'s pool getters, ``req_to_token``, the
KV pool's ``get_key_buffer`` / ``get_value_buffer`` / ``size`` / ``page_size`` and
``CustomLogitProcessor``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
from torch import nn

from genrec.kernels import hstu_native
from genrec.models.hstu import CachedHistory, JaggedMeta, PagedMeta
from genrec.models.recommender import HistoryState
from genrec.serve.ann import RetrievalConfig
from genrec.serve.engine import TorchEngine
from genrec.serve.requests import UserInput
from genrec.serve.retrieval import Pair, Retrieved, generate, merge_sources
from genrec.serve.sglang_models.codec import (
    EMPTY,
    ERROR_INFO,
    EVENTS,
    PAYLOAD,
    VOCAB,
    encode_row,
    failed_row,
    stack_rows,
    unpack_events,
    unpack_ints,
)

log = logging.getLogger("genrec.serve.sglang")


class KeepLogits(CustomLogitProcessor):
    """A no-op custom logit processor: attached to every request so that SGLang hands the
    requests' custom params (our payload) to the forward batch."""

    def __call__(self, logits, custom_param_list=None):  # noqa: ANN001, ANN204
        return logits


class _Ask:
    """What retrieval reads of a work (``Catalogue.top_k``, ``serve.retrieval.generate`` and
    ``merge_sources``): k, the source, the beam and the items left out."""

    def __init__(self, k: int, excluded: np.ndarray | None, source: str = "dense", beam: int = 0) -> None:
        self.retrieve_k, self._excluded, self.source, self.beam = k, excluded, source, beam

    def excluded(self) -> np.ndarray | None:
        return self._excluded


@dataclass
class _Part:
    """The requests of one extend pass that the tower computes (those with genrec's payload):
    their rows in the batch, payloads (and their histories' events, [4, n] each: codec.EVENTS),
    cached and new tokens, the new tokens' positions and pool slots [T], and their req-to-token
    rows [b]."""

    index: list[int]
    payloads: list[dict]
    events: list[np.ndarray]
    pre: list[int]
    ext: list[int]
    positions: torch.Tensor
    loc: torch.Tensor
    pool_rows: torch.Tensor


class GenRecHSTU(nn.Module):
    """SGLang model (EntryClass): a genrec artifact's HSTU model over SGLang's KV pool.

    ``config.genrec_artifact`` names the artifact; the model loads it itself (its quantized
    tables, tower and heads) through a ``TorchEngine`` whose lookups, retrieval and ranking
    it reuses. Each forward returns one row of ``codec`` per request (``hidden_states``,
    capture mode "last"): the dense top-k, the beam's items, task probabilities; a header of
    zeros for a chunk that does not end its request. The logits are a dummy [B, VOCAB]: every
    request is one greedy token.

    With a semantic-ID decoder the payload's ``beam`` (> 0) asks for the decoder's beam of the
    request's user vector (module docstring); a payload ``prompt`` [D] brings the vector itself.
    """

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:  # noqa: ANN001
        super().__init__()
        torch.set_num_threads(int(getattr(config, "genrec_threads", 1)) or torch.get_num_threads())
        retrieval = RetrievalConfig(**(getattr(config, "genrec_retrieval", None) or {}))  # [serve.retrieval]
        # [serve.scoring]: the candidates scored in the precision the server was configured with
        precision = getattr(config, "genrec_candidate_precision", None) or "fp32"
        self.engine = TorchEngine(config.genrec_artifact, retrieval=retrieval, candidate_precision=precision)
        self.model = self.engine.model.eval()
        packed = self.engine.packed  # its token lookups and context (SGLangEngine checked it exists)
        if packed is None:
            raise ValueError("GenRecHSTU serves HSTU models with the summed action encoding (the packed path)")
        self.packed = packed
        self.tasks = len(self.engine.schema.tasks)
        self.slot_times: torch.Tensor | None = None  # [pool slots] each slot's event time
        self.pool_checked = False
        self.head = self.model.sid_head  # the semantic-ID decoder (None: the model has none)
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
        rows = [EMPTY] * b  # one row per request; padded to the batch's longest
        errors: list[str | None] = [None] * b
        logits = torch.zeros(b, VOCAB)
        if not fb.forward_mode.is_extend():  # (every request is one token: nothing decodes)
            return LogitsProcessorOutput(next_token_logits=logits, hidden_states=stack_rows(rows))
        params = fb.sampling_info.custom_params if fb.sampling_info is not None else None
        payloads = [p.get(PAYLOAD) if isinstance(p, dict) else None for p in (params or [None] * b)]
        pre, ext = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        for i, p in enumerate(payloads):
            if p is None:
                log.error("GenRecHSTU: a request without genrec's payload; send requests through SGLangEngine")
                errors[i] = "a request without genrec's payload (send requests through SGLangEngine)"
        prompted = [i for i, p in enumerate(payloads) if p is not None and "prompt" in p]
        tower = [i for i, p in enumerate(payloads) if p is not None and "prompt" not in p]
        if prompted:
            self._prompted(prompted, payloads, rows, errors)
        if tower:
            self._tower(fb, tower, payloads, pre, ext, positions, rows, errors)
        info = {ERROR_INFO: errors} if any(e is not None for e in errors) else None
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=stack_rows(rows), customized_info=info)

    def _tower(self, fb, tower: list[int], payloads: list, pre: list[int], ext: list[int],  # noqa: ANN001
               positions: torch.Tensor, rows: list[torch.Tensor], errors: list[str | None]) -> None:
        """The tower requests of this pass, together; if that raises, one at a time, so that
        only the request at fault fails (its row failed, its reason in ``errors``)."""
        try:
            self._tower_part(self._part(fb, tower, payloads, pre, ext, positions), rows)
            return
        except Exception as e:  # noqa: BLE001 - a fault must not reach SGLang's scheduler (module docstring)
            log.exception("GenRecHSTU: a tower pass of %d requests failed", len(tower))
            if len(tower) == 1:
                rows[tower[0]], errors[tower[0]] = failed_row(ext[tower[0]]), _reason(e)
                return
        for i in tower:  # one at a time: only the request at fault fails
            try:
                self._tower_part(self._part(fb, [i], payloads, pre, ext, positions), rows)
            except Exception as e:  # noqa: BLE001
                log.error("GenRecHSTU: request %d of the pass failed alone: %s", i, _reason(e))
                rows[i], errors[i] = failed_row(ext[i]), _reason(e)

    def _tower_part(self, part: _Part, rows: list[torch.Tensor]) -> None:
        h, kv = self._extend(part)
        done = [j for j in range(len(part.index)) if part.pre[j] + part.ext[j] == part.events[j].shape[1]]
        if done:
            self._finish(part, done, h, kv, rows)

    # ----- semantic-ID beams -------------------------------------------------------------
    def _generate(self, users: torch.Tensor, asks: list[tuple[int, _Ask]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The decoder's beams of ``users`` [B, D] (row j: ``asks``' work j) by the torch engine's
        ``serve.retrieval.generate`` -> {j: (catalogue positions [g] int64, log-probabilities [g])}."""
        if self.head is None:
            raise ValueError("this model has no semantic-ID decoder (model.sid)")
        corpus = self.engine.corpus_np
        got = generate(self.head, self.engine.catalogue, users, asks, self.model.cfg.sid.beam_width)  # type: ignore[arg-type]
        return {j: (torch.from_numpy(np.searchsorted(corpus, ids).astype(np.int64)), torch.from_numpy(logp))
                for j, (ids, logp) in got.items()}

    def _prompted(self, index: list[int], payloads: list, rows: list[torch.Tensor], errors: list[str | None]) -> None:
        """Requests that bring their user vector (payload ``prompt`` [D], ``beam``, ``excluded``):
        their beams together, into ``rows``; a failure fails them (the reason in ``errors``)."""
        try:
            users = torch.tensor([payloads[i]["prompt"] for i in index], dtype=torch.float32)
            asks = [(j, _Ask(0, unpack_ints(payloads[i]["excluded"]), "generative", int(payloads[i]["beam"])))
                    for j, i in enumerate(index)]
            got = self._generate(users, asks)
            none = torch.zeros(0, dtype=torch.int64)
            for j, i in enumerate(index):
                rows[i] = encode_row(none, none.float(), torch.zeros(0, self.tasks), 1, generated=got[j])
        except Exception as e:  # noqa: BLE001 - a fault must not reach SGLang's scheduler (module docstring)
            log.exception("GenRecHSTU: %d beams failed", len(index))
            for i in index:
                rows[i], errors[i] = failed_row(1), _reason(e)

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
        return _Part(index, [payloads[i] for i in index], [unpack_events(payloads[i]["events"]) for i in index],
                     [pre[i] for i in index], [ext[i] for i in index], pos, loc, pool_rows)

    def _extend(self, part: _Part):  # noqa: ANN202
        """The part's new tokens through the tower over the pool -> (their outputs [T, D],
        (slot map [B, L], the pool, each request's tokens after this pass [B]))."""
        m, pre, ext = self.model, part.pre, part.ext
        new = np.concatenate([ev[:, s : s + e] for ev, s, e in zip(part.events, pre, ext)], axis=1)
        cols = {key: np.ascontiguousarray(new[r]) for r, key in enumerate(EVENTS)}
        pos = part.positions
        # the new tokens' positions from the host's lengths (prefix + offset: SGLang's positions of
        # an extend), not read back from the device
        host_pos = np.concatenate([np.arange(s, s + e, dtype=np.int64) for s, e in zip(pre, ext)])
        x = self.packed.tokens(cols["items"], cols["actions"], host_pos)
        pool, r2t = get_token_to_kv_pool(), get_req_to_token_pool().req_to_token
        if not self.pool_checked:
            check_pool(pool)
            self.pool_checked = True
        dev = part.loc.device  # the pool's (slot tensors live beside it)
        if self.slot_times is None or self.slot_times.numel() < pool.size + pool.page_size:
            self.slot_times = torch.zeros(pool.size + pool.page_size, dtype=torch.int64, device=dev)
        loc = part.loc
        self.slot_times[loc] = torch.from_numpy(cols["times"]).to(dev)
        lengths = torch.tensor([s + e for s, e in zip(pre, ext)], dtype=torch.int64)
        slots = r2t[part.pool_rows, : int(lengths.max())].to(torch.int64)  # [B, L]
        seq = torch.repeat_interleave(torch.arange(len(pre)), torch.tensor(ext))

        def store(layer: int, kk: torch.Tensor, vv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Writes the layer's new keys / values at their slots; hands back the pool buffers
            [S, H, D] themselves (read in place through ``slots``: no per-layer copy)."""
            kb, vb = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            kb[loc], vb[loc] = kk.to(kb.dtype), vv.to(vb.dtype)
            return kb, vb

        if not any(pre) and self.packed.backend == "native":
            return self._encode_native(x, cols, ext, loc, pool), (slots, pool, lengths)
        tb = m.tower.time_bias
        if self.packed.backend == "native" and not m.tower.cfg.window and dev.type == "cpu" and (
                pool.get_key_buffer(0).dtype == torch.float32):
            return self._extend_native(x, cols, pre, ext, slots, lengths, pool), (slots, pool, lengths)
        if m.tower.cfg.window:  # a bounded tower: each request's keys / values read out of the pool
            def gathered(layer: int, kk: torch.Tensor, vv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                kb, vb = store(layer, kk, vv)
                return kb[slots].to(kk.dtype), vb[slots].to(vv.dtype)  # [B, L, H, D]

            meta = PagedMeta(seq.to(dev), pos, lengths.to(dev), self.slot_times[slots] if tb else None,
                             torch.from_numpy(cols["qtimes"]).to(dev) if tb else None)
            return m.tower.extend_paged(x, meta, gathered), (slots, pool, lengths)
        meta = PagedMeta(seq.to(dev), pos, lengths.to(dev), None,
                         torch.from_numpy(cols["qtimes"]).to(dev) if tb else None, slots=slots,
                         slot_times=self.slot_times if tb else None)
        return m.tower.extend_paged(x, meta, store), (slots, pool, lengths)

    def _extend_native(self, x: torch.Tensor, cols: dict, pre: list[int], ext: list[int], slots: torch.Tensor,  # noqa: ANN001
                       lengths: torch.Tensor, pool) -> torch.Tensor:
        """Requests with cached prefixes (returning users) on CPU: the tower's C++ extend over
        the pool in place (``tower.extend_native`` with the slot map: each layer's new keys /
        values written at the requests' slots, the cached ones read where they lie, as the torch
        engine's cache extends). Returns outputs [T, D] of which only each request's last row is
        set (the only one read)."""
        m = self.model
        ks, vs = self._pool_rows(pool)
        st = self.slot_times  # (set by _extend before it calls this)
        key_times = st[slots].numpy() if m.tower.time_bias and st is not None else None
        last = m.tower.extend_native(x, ks, vs, np.asarray(pre, np.int64), lengths.numpy(), key_times,
                                     cols["qtimes"] if key_times is not None else None, slots.numpy())
        h = x.new_zeros(x.shape[0], last.shape[1])
        h[torch.from_numpy(np.cumsum(ext) - 1)] = last.to(h.dtype)
        return h

    def _pool_rows(self, pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
        """The pool's per-layer key and value buffers as rows of H * D values (views, for the
        C++ kernels' slot maps)."""
        c = self.model.tower.kv_dims()
        return ([pool.get_key_buffer(i).view(-1, c.key_width) for i in range(c.layers)],
                [pool.get_value_buffer(i).view(-1, c.value_width) for i in range(c.layers)])

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
        part): retrieval (dense, the decoder's beam, both fused) and ranking, into ``rows``."""
        eng, m, payloads, ext = self.engine, self.model, part.payloads, part.ext
        slots, pool, lengths = kv
        ends = np.cumsum(ext) - 1
        users = m.head.normalize(h[torch.as_tensor(ends[done])].float())  # [d, D]
        # the requests' histories as the candidates' extend reads them, read from the pool once,
        # straight into the layout the scoring kernel takes ([layers, Th, H D]; no second copy)
        flat = torch.cat([slots[i, : int(lengths[i])] for i in done])
        offsets = torch.zeros(len(done) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths[done], 0)
        request = torch.tensor([part.events[i][EVENTS.index("qtimes"), -1] for i in done], dtype=torch.int64)
        times = self.slot_times[flat] if m.tower.time_bias and self.slot_times is not None else None
        hist = self._history(pool, flat, offsets, times, request if m.tower.time_bias else None, users.dtype)
        none = np.zeros(0, np.int64)
        ctx = self.packed.context([UserInput(none, none, none, True, 0, {n: np.asarray(v, np.int64) for n, v in
                                                                         payloads[i]["context"].items()}) for i in done])
        state = HistoryState(hist, lengths[done].clone(), ctx)
        asks = {j: _Ask(payloads[i]["k"], unpack_ints(payloads[i]["excluded"]), payloads[i].get("source", "dense"),
                        int(payloads[i].get("beam", 0))) for j, i in enumerate(done)}
        need = [(j, a) for j, a in asks.items() if a.retrieve_k and a.source != "generative"]
        found: dict[int, Pair] = eng.catalogue.top_k(users, need) if need else {}
        beams = [(j, a) for j, a in asks.items() if a.beam]
        generated = self._generate(users, beams) if beams else {}
        # what the beam's works retrieve: its items (fused with the dense top-k for "both"), as the
        # front end merges them again from the row (merge_sources is a function of the two lists)
        merged: dict[int, Pair | Retrieved] = merge_sources(  # (_Ask: what merge_sources reads of a Work)
            beams, found, {j: (eng.corpus_np[g[0].numpy()], g[1].numpy()) for j, g in generated.items()})  # type: ignore[arg-type]
        to_rank = {}
        for j, i in enumerate(done):
            p = payloads[i]
            if p["rank"] == "given":
                given = unpack_ints(p["candidates"])
                if given is None:
                    raise ValueError("a payload that ranks given candidates carries none")
                to_rank[j] = (given,)
            elif p["rank"] == "retrieved":
                to_rank[j] = (merged[j][0] if j in merged else found[j][0],)
        probs = eng.score(state, to_rank) if to_rank else {}
        for j, i in enumerate(done):
            ids, scores = found.get(j, (np.zeros(0, np.int64), np.zeros(0, np.float32)))
            pr = probs.get(j, np.zeros((0, self.tasks), np.float32))
            pos = torch.from_numpy(np.searchsorted(eng.corpus_np, ids).astype(np.int64))
            rows[part.index[i]] = encode_row(pos, torch.from_numpy(scores), torch.from_numpy(pr), ext[i],
                                             generated=generated.get(j))


    def _history(self, pool, flat: torch.Tensor, offsets: torch.Tensor, times: torch.Tensor | None,  # noqa: ANN001
                 request: torch.Tensor | None, dtype: torch.dtype) -> CachedHistory:
        """The histories at pool slots ``flat`` [Th] (``offsets`` [d+1]) for the candidates' scoring.
        On CPU with an fp32 pool, the pool's buffers themselves and the slot map: the C++ scorer
        reads the rows where they lie (a PyTorch scorer gathers them, ``NativeHistory.layer``);
        elsewhere per-layer [Th, H, D] tensors."""
        c = self.model.tower.kv_dims()
        kb0 = pool.get_key_buffer(0)
        if kb0.device.type == "cpu" and self.packed.backend == "native" and kb0.dtype == torch.float32:
            ks, vs = self._pool_rows(pool)
            native = hstu_native.history(ks, vs, offsets, times, request, rows=flat.numpy())
            return CachedHistory([], offsets, times, request, native)
        layers = [(pool.get_key_buffer(i)[flat].to(dtype).view(-1, c.heads, c.key_dim),
                   pool.get_value_buffer(i)[flat].to(dtype).view(-1, c.heads, c.value_dim))
                  for i in range(c.layers)]
        return CachedHistory(layers, offsets, times, request)


def check_pool(pool) -> None:  # noqa: ANN001
    """Refuses a KV pool this model cannot write in place: the model writes each layer's keys and
    values into ``get_key_buffer`` / ``get_value_buffer``, which a quantized pool (fp8 / fp4 with
    scales) hands out as dequantized copies, so the writes would be lost without a word."""
    k = pool.get_key_buffer(0)
    copies = k.data_ptr() != pool.get_key_buffer(0).data_ptr()
    if getattr(pool, "is_quantized_kv_cache", False) or copies or not k.dtype.is_floating_point or k.dtype.itemsize < 2:
        raise ValueError(f"GenRecHSTU writes keys and values into SGLang's KV pool in place; this pool "
                         f"({type(pool).__name__}, {k.dtype}) is quantized and hands out copies, so the writes would "
                         "be lost: serve with kv_cache_dtype = auto (the model's float dtype)")


def _reason(e: BaseException) -> str:
    """What a failed request's caller is told (bounded: it travels back with the answer)."""
    return f"{type(e).__name__}: {e}"[:300]


EntryClass = GenRecHSTU
