"""Retrieval from each work's source: the dense top-k, the semantic-ID decoder's beam, or both
fused.

    users [B, D] --Catalogue.top_k--> dense (ids, logits)        (source dense / both)
                 --generate---------> beam (ids, log-probs)      (source generative / both)
    --merge_sources--> per work: the dense pair, or ``Retrieved`` (beam / fused, each source's
                       scores kept)

Pure functions of the model's outputs: the torch engine calls them after its encode, the
SGLang front end merges what its model returned with :func:`merge_sources`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from genrec.models.sid_decoder import SIDDecoder
from genrec.serve.accounting import mark
from genrec.serve.catalogue import Catalogue
from genrec.serve.requests import Work

_NONE = np.zeros(0, np.int64)
# reciprocal-rank fusion's constant (Cormack et al., 2009): an item at rank r of a list adds
# 1 / (RRF_K + r); 60 keeps a list's head from outweighing agreement between the lists
RRF_K = 60
Pair = tuple[np.ndarray, np.ndarray]  # (item ids [n], scores [n]), best first


class Retrieved(NamedTuple):
    """What a work retrieved from more than the dense source (:func:`merge_sources`); a
    dense-only work keeps the plain (ids, scores) pair the dense top-k returns."""

    ids: np.ndarray  # [n] item ids, in the retrieval order
    scores: np.ndarray  # [n] the order: log-probability (generative) or fused score (both)
    dense: np.ndarray  # [n] dense logits, NaN where the dense source did not retrieve the item
    generative: np.ndarray | None  # [n] decoder log-probabilities, NaN where the decoder did not (None: dense only)


def channels(got: Pair | Retrieved) -> Retrieved:
    """A work's retrieval as :class:`Retrieved` (a dense (ids, scores) pair: scores are the dense ones)."""
    if isinstance(got, Retrieved):
        return got
    ids, scores = got
    return Retrieved(ids, scores, scores, None)


def generate(head: SIDDecoder, catalogue: Catalogue, users: torch.Tensor, works: Sequence[tuple[int, Work]],
             default_beam: int) -> dict[int, Pair]:
    """Generative retrieval: {work: (item ids [n] int64, log-probabilities [n] float32)}, best
    first, from the decoder's beam search (``SIDDecoder.beam_search``) prompted with the users'
    vectors ``users`` [B, D] (work i's is row i: the vectors dense retrieval reads; the decoder
    normalises its prompt itself). Each work decodes with its own ``Work.beam`` (0: the model's
    ``default_beam``; works sharing a beam share one search) and never gets its
    :meth:`Work.excluded` items; ids the beam could not fill and items outside the catalogue
    are left out (n <= beam)."""
    dtype = next(head.parameters()).dtype
    groups: dict[int, list[tuple[int, Work]]] = defaultdict(list)
    for i, w in works:
        groups[w.beam or default_beam].append((i, w))
    out = {}
    for beam, group in groups.items():
        rows = torch.tensor([i for i, _ in group], device=users.device)
        excluded = [w.excluded() for _, w in group]
        seen = None
        if any(e is not None for e in excluded):  # as beam_search takes them: (ids, lengths [b])
            ex = [_NONE if e is None else e for e in excluded]
            seen = (torch.from_numpy(np.concatenate(ex)).to(users.device),
                    torch.tensor([e.size for e in ex], device=users.device))
        items_t, logp_t = head.beam_search(users.index_select(0, rows).to(dtype), beam, seen)
        items, logp = items_t.cpu().numpy(), logp_t.float().cpu().numpy()
        ok = (items >= 0) & np.isfinite(logp) & catalogue.known(items)
        for j, (i, _) in enumerate(group):
            out[i] = (items[j][ok[j]], logp[j][ok[j]])
    return out


def merge_sources(works: Sequence[tuple[int, Work]], dense: dict[int, Pair],
                  generated: dict[int, Pair]) -> dict[int, Pair | Retrieved]:
    """Each work's retrieval from what its source(s) found (both best first). A dense work keeps
    its (ids, scores) pair; a generative one gets the first ``retrieve_k`` of its beam, ordered
    by log-probability; "both" the deduplicated union of the dense top ``retrieve_k`` and that,
    every item keeping the scores of the sources that found it (``Retrieved``) and ordered by
    reciprocal-rank fusion: score = sum over the lists holding it of 1 / (RRF_K + rank), rank
    from 1; ties keep the dense order, then the beam's. Why fusion: the two scores are on
    different scales (a cosine logit, a log-probability) and cannot be compared; ranks can,
    and an item both sources found comes first."""
    out: dict[int, Pair | Retrieved] = {}
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


def retrieve_sources(catalogue: Catalogue, head: SIDDecoder | None, default_beam: int, users: torch.Tensor,
                     works: Sequence[tuple[int, Work]], stages: dict[str, float],
                     t: float | None = None) -> dict[int, Pair | Retrieved]:
    """Each work's retrieval from its ``Work.source`` (users [B, D], a work's index its row):
    the dense top-k, the decoder's beam (``head``) or both, put together by
    :func:`merge_sources`. The stages "retrieve_topk" (dense, either search) and "generate" are
    timed from ``t``; dense retrieval the ANN index answered is also counted in "retrieve_ann"."""
    t = time.perf_counter() if t is None else t
    dense_w = [(i, w) for i, w in works if w.source != "generative"]
    gen_w = [(i, w) for i, w in works if w.source != "dense"]
    dense = catalogue.top_k(users, dense_w) if dense_w else {}
    t0, t = t, mark(stages, "retrieve_topk", t)
    if dense_w and catalogue.ann is not None:
        stages["retrieve_ann"] = stages.get("retrieve_ann", 0.0) + t - t0
    generated = {}
    if gen_w:
        if head is None:  # (decode refuses such requests: ModelCannot)
            raise ValueError("this model has no semantic-ID decoder (model.sid)")
        generated = generate(head, catalogue, users, gen_w, default_beam)
        mark(stages, "generate", t)
    return merge_sources(works, dense, generated)
