"""What travels between the SGLang engine's two sides, written and read in one place.

The scheduler side (``genrec_tower.GenRecHSTU``) answers each tower request with one float32
row (SGLang's "last" hidden state; SGLang turns it into a Python list after the forward, so
the forward itself never leaves the device for it). The front end (``serve.sglang_engine``)
reads it back with :func:`decode_row`. Layout::

    [n_ret, n_prob, computed, status, pos_hi[n_ret], pos_lo[n_ret], scores[n_ret], probs[n_prob x tasks]]

Catalogue positions are int64 split into two 24-bit halves (``pos = hi * 2^24 + lo``): each half
is exact in float32, so positions stay exact up to 2^48 items (a plain float32 is exact only
below 2^24 = 16.7M). ``status`` 0: answered; 1: the model's forward failed for this request (the
reason travels as customized info under :data:`ERROR_INFO`, its K/V must not be reused).

Also here: the constants both sides must agree on (payload key, customized-info keys, the beam
ticket's token base, the dummy vocabulary of a model without a semantic-ID decoder).
No SGLang import: both processes load this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAYLOAD = "genrec"  # the custom params' key of a request's payload
SID_INFO = "genrec_sid"  # the customized-info key of a beam's result
ERROR_INFO = "genrec_error"  # the customized-info key of a failed request's reason
TICKET_BASE = 1 << 62  # a beam's one prompt token: TICKET_BASE + its ticket (never a trie node id)
VOCAB = 4  # the dummy logits' width of a model without a semantic-ID decoder (nothing is decoded)
HEADER = 4
OK, FAILED = 0, 1
_HALF = 1 << 24


def encode_row(positions: torch.Tensor, scores: torch.Tensor, probs: torch.Tensor, computed: int,
               status: int = OK) -> torch.Tensor:
    """One request's answer as a float32 row on the inputs' device: retrieved catalogue
    ``positions`` [n] int64 (0 <= pos < 2^48), their ``scores`` [n], task probabilities
    ``probs`` [p, tasks], ``computed``: tokens the pass computed for the request."""
    dev = positions.device
    pos = positions.to(torch.int64)
    head = torch.tensor([pos.numel(), probs.shape[0], computed, status], dtype=torch.float32, device=dev)
    return torch.cat([head, (pos // _HALF).to(torch.float32), (pos % _HALF).to(torch.float32),
                      scores.to(torch.float32).reshape(-1), probs.to(torch.float32).reshape(-1)])


def failed_row(computed: int = 0) -> torch.Tensor:
    """The row of a request whose forward failed (nothing in it is an answer)."""
    return torch.tensor([0, 0, computed, FAILED], dtype=torch.float32)


EMPTY = torch.zeros(HEADER)  # the row of a request this pass does not end (a chunk of it)


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, longest row] the rows zero-padded (each row's header says what it holds)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if rows else torch.zeros(0, HEADER)


@dataclass
class Answer:
    """A decoded row: retrieved ``positions`` [n] int64 and ``scores`` [n] float32, task
    probabilities ``probs`` [p, tasks], ``computed`` tokens, ``status`` (OK / FAILED)."""

    positions: np.ndarray
    scores: np.ndarray
    probs: np.ndarray
    computed: int
    status: int


def decode_row(row: np.ndarray | list, tasks: int) -> Answer:
    """The inverse of :func:`encode_row` (``row`` may carry zero padding past its end)."""
    r = np.asarray(row, np.float32)
    n, p, computed, status = (int(v) for v in r[:HEADER])
    at = HEADER
    hi, lo = r[at : at + n].astype(np.int64), r[at + n : at + 2 * n].astype(np.int64)
    at += 2 * n
    scores = r[at : at + n].copy()
    at += n
    probs = r[at : at + p * tasks].reshape(p, tasks).copy()
    return Answer(hi * _HALF + lo, scores, probs, computed, status)
