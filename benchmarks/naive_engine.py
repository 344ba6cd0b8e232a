"""The serving baseline: one request at a time, eager, no shared history encoding.

Retrieval encodes the history; ranking appends the candidates to the history and runs the
whole tower again (``model.rank``). Same model, same scores, none of the serving work: what a
first deployment would do, and what the serving benchmark's "x naive" is measured against.

It serves like ``genrec serve`` (the same flags and [serve] keys; run it with
``--serve.batch.max_batch=1``), its engine built by :func:`make` in the engine process::

    python -m genrec.benchmarks.naive_engine --artifact DIR --port 50051 --serve.batch.max_batch=1
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from genrec.serve.ann import RetrievalConfig
from genrec.serve.contract import Engine, Result
from genrec.serve.engine import TorchEngine
from genrec.serve.kvcache import CacheConfig
from genrec.serve.layout import collate_users
from genrec.serve.ranking import given, ranked_result, retrieved_result
from genrec.serve.requests import Work
from genrec.serve.retrieval import channels
from genrec.serve.scoring import ScoringConfig


class NaiveTorchEngine(TorchEngine):
    """The baseline engine (module docstring): the torch engine's model, catalogue and
    accounting, one work at a time through the model's batch path."""

    name = "naive"

    def __init__(self, artifact: str | Path, device: str = "cpu", **kwargs) -> None:  # noqa: ANN003
        super().__init__(artifact, device, packed=False, **kwargs)  # eager, the model's own path

    @torch.inference_mode()
    def run(self, works: list[Work]) -> list[Result]:
        return self.accounting.account(works, [self._one(w) for w in works])

    def _one(self, w: Work) -> Result:
        t0 = time.perf_counter()
        batch = collate_users([w.user], self.model, self.device, window_block=self.window_block)
        users = self.model.user_embeddings(batch)
        retrieves = w.kind == "retrieve" or w.candidates is None
        got = channels(self.retrieve_sources(users, [(0, w)])[0]) if retrieves else None
        if got is not None and not self.ranking.ranks(w, True):
            result = retrieved_result(got, w)
        else:
            if w.candidates is not None:
                cands, out_ids, bids = given(w.candidates, w)
            elif got is not None:
                cands = out_ids = got.ids
                bids = np.ones(cands.size)
            batch = collate_users([w.user], self.model, self.device, candidates=[cands], window_block=self.window_block)
            probs = self.model.rank(batch).float().cpu().numpy()
            tasks = {t: probs[:, j] for j, t in enumerate(self.schema.tasks)}
            value = self.ranking.order(w.objective, tasks, bids, got.scores if got else None)
            result = ranked_result(w, out_ids, value, tasks, got)
        result.compute_ms = (time.perf_counter() - t0) * 1e3
        return result


def make(kind: str, artifact: str, device: str, cache: CacheConfig | None = None,
         retrieval: RetrievalConfig | None = None, scoring: ScoringConfig | None = None) -> Engine:
    """The naive engine for ``artifact`` (an engine builder: ``serve.worker.EngineProcess(build=)``):
    the same history window as the server's cache config, no cache; the server's catalogue search;
    candidates in the model's precision (another ``scoring`` is refused)."""
    if scoring is not None and scoring.candidate_precision != "fp32":
        raise ValueError("the naive engine scores candidates in the model's precision: serve.scoring.candidate_precision "
                         "must be fp32")
    return NaiveTorchEngine(artifact, device=device, window_block=cache.window_block if cache else 1,
                            retrieval=retrieval)


def main(argv: Sequence[str] | None = None) -> int:
    """``genrec serve`` with the naive engine (its flags and overrides)."""
    from genrec.cli import build_parser
    from genrec.serve.cli import cmd_serve

    args, rest = build_parser().parse_known_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return cmd_serve(args, rest, build=make)


if __name__ == "__main__":
    raise SystemExit(main())
