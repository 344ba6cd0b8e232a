"""``[serve.retrieval]``: which search answers dense retrieval (serve.catalogue runs it).

A module of its own, importing nothing heavy, so that the server's config (serve.server) and the
engine factory can name it without loading the model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Search = Literal["auto", "exact", "ann"]


@dataclass(frozen=True)
class RetrievalConfig:
    """``[serve.retrieval]``: how dense retrieval searches the catalogue. ``search``: "auto"
    (the artifact's ANN index where it has one, else exact), "exact" (every item scored: the
    reference), "ann" (the index; an artifact without one is refused at load). ``nprobe`` /
    ``shortlist``: the index's lists probed and candidates re-scored per user (0: the values
    ``genrec quantize`` calibrated, in the manifest's ``index``)."""

    search: Search = "auto"
    nprobe: int = 0
    shortlist: int = 0

    def __post_init__(self) -> None:
        if self.search not in ("auto", "exact", "ann"):
            raise ValueError(f"serve.retrieval.search = {self.search!r}; choose auto, exact or ann")
        if self.nprobe < 0 or self.shortlist < 0:
            raise ValueError("serve.retrieval.nprobe and .shortlist must be >= 0 (0: the artifact's)")
