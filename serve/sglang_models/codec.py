"""What travels between the SGLang engine's two sides, written and read in one place.

The scheduler side (``genrec_tower.GenRecHSTU``) answers each tower request with one float32
row (SGLang's "last" hidden state; SGLang turns it into a Python list after the forward, so
the forward itself never leaves the device for it). The front end (``serve.sglang_engine``)
reads it back with :func:`decode_row`. Layout::

    [n_ret, n_prob, computed, status, n_gen,
     pos_hi[n_ret], pos_lo[n_ret], scores[n_ret],          the dense top-k
     gen_hi[n_gen], gen_lo[n_gen], gen_logp[n_gen],        the semantic-ID beam's items
     probs[n_prob x tasks]]

Catalogue positions are int64 split into two 24-bit halves (``pos = hi * 2^24 + lo``): each half
is exact in float32, so positions stay exact up to 2^48 items (a plain float32 is exact only
below 2^24 = 16.7M). The beam's log-probabilities are float32 as the decoder computes them. ``status`` 0: answered; 1: the model's forward failed for this request (the
reason travels as customized info under :data:`ERROR_INFO`, its K/V must not be reused).

Also here: the request payload's arrays, and the constants both sides must agree on (payload
key, customized-info key, the dummy vocabulary: the model decodes nothing through SGLang's
sampler). A payload's integer arrays travel as raw int64 bytes (:func:`pack_ints`,
:func:`pack_events`), not Python lists: SGLang pickles every request to its scheduler, and
lists of a long history's events cost 3.5 ms a call to build, pickle and read back at 8,000
events against 0.15 ms as bytes.
No SGLang import: both processes load this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAYLOAD = "genrec"  # the custom params' key of a request's payload
ERROR_INFO = "genrec_error"  # the customized-info key of a failed request's reason
VOCAB = 4  # the dummy logits' width (every request is one greedy token: nothing is decoded)
HEADER = 5
OK, FAILED = 0, 1
_HALF = 1 << 24
EVENTS = ("items", "actions", "times", "qtimes")  # the rows of a payload's "events" (pack_events)


def pack_ints(values: np.ndarray | None) -> bytes | None:
    """An integer array as int64 bytes for a payload (None stays None)."""
    return None if values is None else np.ascontiguousarray(values, np.int64).tobytes()


def unpack_ints(data: bytes | None) -> np.ndarray | None:
    """:func:`pack_ints`' array back (read-only, no copy)."""
    return None if data is None else np.frombuffer(data, np.int64)


def pack_events(items: np.ndarray, actions: np.ndarray, times: np.ndarray, qtimes: np.ndarray) -> bytes:
    """A history's events, one [4, n] int64 block (rows in :data:`EVENTS` order)."""
    return np.stack([np.asarray(c, np.int64) for c in (items, actions, times, qtimes)]).tobytes()


def unpack_events(data: bytes) -> np.ndarray:
    """:func:`pack_events`' block back: [4, n] int64 (read-only, no copy)."""
    return np.frombuffer(data, np.int64).reshape(len(EVENTS), -1)


def _halves(pos: torch.Tensor) -> list[torch.Tensor]:
    pos = pos.to(torch.int64)
    return [(pos // _HALF).to(torch.float32), (pos % _HALF).to(torch.float32)]


def encode_row(positions: torch.Tensor, scores: torch.Tensor, probs: torch.Tensor, computed: int,
               status: int = OK, generated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One request's answer as a float32 row on the inputs' device: the dense top-k's catalogue
    ``positions`` [n] int64 (0 <= pos < 2^48) and ``scores`` [n], task probabilities ``probs``
    [p, tasks], ``computed``: tokens the pass computed for the request; ``generated``: the
    semantic-ID beam's (catalogue positions [g] int64, log-probabilities [g]), best first."""
    dev = positions.device
    gen_pos, gen_logp = generated if generated is not None else (positions[:0], scores[:0])
    head = torch.tensor([positions.numel(), probs.shape[0], computed, status, gen_pos.numel()],
                        dtype=torch.float32, device=dev)
    return torch.cat([head, *_halves(positions), scores.to(torch.float32).reshape(-1),
                      *_halves(gen_pos.to(dev)), gen_logp.to(dev, torch.float32).reshape(-1),
                      probs.to(torch.float32).reshape(-1)])


def failed_row(computed: int = 0) -> torch.Tensor:
    """The row of a request whose forward failed (nothing in it is an answer)."""
    return torch.tensor([0, 0, computed, FAILED, 0], dtype=torch.float32)


EMPTY = torch.zeros(HEADER)  # the row of a request this pass does not end (a chunk of it)


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, longest row] the rows zero-padded (each row's header says what it holds)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if rows else torch.zeros(0, HEADER)


@dataclass
class Answer:
    """A decoded row: the dense top-k's ``positions`` [n] int64 and ``scores`` [n] float32, task
    probabilities ``probs`` [p, tasks], ``computed`` tokens, ``status`` (OK / FAILED), the
    beam's ``gen_positions`` [g] int64 and ``gen_scores`` [g] float32 (log-probabilities)."""

    positions: np.ndarray
    scores: np.ndarray
    probs: np.ndarray
    computed: int
    status: int
    gen_positions: np.ndarray
    gen_scores: np.ndarray


def decode_row(row: np.ndarray | list, tasks: int) -> Answer:
    """The inverse of :func:`encode_row` (``row`` may carry zero padding past its end)."""
    r = np.asarray(row, np.float32)
    n, p, computed, status, g = (int(v) for v in r[:HEADER])
    at = HEADER

    def take(count: int) -> np.ndarray:
        nonlocal at
        at += count
        return r[at - count : at].copy()

    def positions(count: int) -> np.ndarray:
        hi, lo = take(count).astype(np.int64), take(count).astype(np.int64)
        return hi * _HALF + lo

    pos, scores = positions(n), take(n)
    gen_pos, gen_scores = positions(g), take(g)
    probs = take(p * tasks).reshape(p, tasks)
    return Answer(pos, scores, probs, computed, status, gen_pos, gen_scores)
