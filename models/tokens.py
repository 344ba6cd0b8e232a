"""Events -> tower tokens, for the two action encodings.

A batch holds, per user, ``h`` history events followed by ``k`` candidates (k =
``num_targets``, 0 without ranking). Every event has an item row and, when the model has
an ``action`` feature, an action row (id 0 = unknown, which candidates always are).

* ``summed``: one token per event, item row + action row (+ any other sequence feature).
* ``interleaved``: per history event an item token then an action token; candidates are
  item tokens only. The action token is what predicts the next item; the item token of a
  candidate is what ranking reads.

Times: events without real timestamps use their event index (token pairs share it).
Returns the rows the heads read: ``retrieval_rows`` (one per history event, predicting
the next item), ``candidate_rows`` and ``last_rows`` (the user vector after the history).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor

from genrec.kernels.jagged import jagged_index, lengths_to_offsets
from genrec.models.inputs import SequenceBatch


@dataclass
class Tokens:
    x: torch.Tensor  # [M, D] token inputs (unscaled, no position)
    offsets: torch.Tensor  # [B+1]
    positions: torch.Tensor  # [M] token index within its sequence
    max_len: int
    timestamps: torch.Tensor  # [M]
    query_times: torch.Tensor  # [M]
    num_targets: torch.Tensor | None  # [B]
    retrieval_rows: torch.Tensor  # [sum h]
    candidate_rows: torch.Tensor  # [sum k]
    last_rows: torch.Tensor  # [B]


def _event_times(batch: SequenceBatch, seg: torch.Tensor, pos: torch.Tensor,
                 hist_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Event times and query times per event. Without real timestamps, history event j is
    at time j and is queried at j + 1; every candidate sits, and is queried, at time h
    (the history length), as a real candidate sits at the request time."""
    is_hist = pos < hist_len
    fake_t = torch.where(is_hist, pos, hist_len)
    fake_q = torch.where(is_hist, pos + 1, hist_len)
    if batch.has_time is None or batch.timestamps is None:
        return fake_t, fake_q
    real = batch.has_time[seg]
    return torch.where(real, batch.timestamps, fake_t), torch.where(real, batch.query_times, fake_q)


def layout(jts: dict[str, JaggedTensor], batch: SequenceBatch, item_feature: str, interleaved: bool) -> Tokens:
    item = jts[item_feature]
    offsets = item.offsets()
    lengths = offsets[1:] - offsets[:-1]
    t = item.values().shape[0]
    seg, pos = jagged_index(offsets, t)
    nt = batch.num_targets
    hist_len = lengths - nt if nt is not None else lengths
    is_hist = pos < hist_len[seg]
    ts, qt = _event_times(batch, seg, pos, hist_len[seg])
    others = [jt.values() for name, jt in jts.items() if name not in (item_feature, "action")]
    x_item = item.values()
    for o in others:
        x_item = x_item + o
    action = jts["action"].values() if "action" in jts else None
    if not interleaved or action is None:
        x = x_item if action is None else x_item + action
        rows = torch.arange(t, device=x.device)
        # candidates share the position right after the history (scored alone or together alike)
        return Tokens(x, offsets, torch.minimum(pos, hist_len[seg]), batch.max_len, ts, qt, nt, rows[is_hist], rows[~is_hist],
                      offsets[1:] - 1 if nt is None else offsets[:-1] + hist_len - 1)
    # interleaved: event p < h -> tokens 2p (item), 2p + 1 (action); candidate c -> 2h + c
    new_lengths = lengths + hist_len
    new_offsets = lengths_to_offsets(new_lengths)
    item_pos = torch.where(is_hist, 2 * pos, pos + hist_len[seg])
    item_rows = new_offsets[seg] + item_pos
    action_rows = (item_rows + 1)[is_hist]
    m = int(new_offsets[-1])
    x = x_item.new_zeros(m, x_item.shape[1])
    x = x.index_put((item_rows,), x_item).index_put((action_rows,), action[is_hist])
    tok_ts = ts.new_zeros(m).index_put((item_rows,), ts).index_put((action_rows,), ts[is_hist])
    # an item token asks "what will the user do with this item" (at its own time); an action
    # token asks "what comes next" (at the next event's time)
    tok_qt = ts.new_zeros(m).index_put((item_rows,), ts).index_put((action_rows,), qt[is_hist])
    _, tok_pos = jagged_index(new_offsets, m)
    tok_seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), new_lengths, output_size=m)
    tok_pos = torch.minimum(tok_pos, 2 * hist_len[tok_seg])
    max_len = int(new_lengths.max()) if new_lengths.numel() else 0
    return Tokens(x, new_offsets, tok_pos, max_len, tok_ts, tok_qt, nt, action_rows, item_rows[~is_hist],
                  new_offsets[:-1] + 2 * hist_len - 1)
