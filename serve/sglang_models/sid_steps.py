"""The semantic-ID decoder's steps as SGLang decodes them (pure PyTorch; the SGLang glue is
``serve.sglang_engine``).

SGLang's built-in beam search picks each level's codes from the logits the model returns, so
the trie lives in the vocabulary: a code token's id is its *trie node* (a prefix of codes), so
a row's input token alone says which prefix it extends, and the row's logits are finite only
at that node's children (``SemanticIds.step``). Ids::

    [0, dead)                       padding: "no beam here" (see below)
    [base[d], base[d] + nodes(d))   the trie's nodes at depth d = 1..L (depth L: the items)

A row at level l (its position: the prompt token is position 0) holds a depth-l node; its
decoder input is the prompt and the node's codes (``paths[l]``), recomputed at every step: at
most L tokens through a decoder of a few layers, as ``SIDDecoder.beam_search`` does, instead of
K/V in SGLang's pool, whose every slot would then carry the decoder's layers beside the tower's.

Padding ids: SGLang scores each row's top 2 x beam logits; a row with fewer finite logits
hands it -inf candidates whose token ids are arbitrary, and a beam wider than the live
(prefix, code) pairs selects them. Every live row therefore also gives the ``dead`` padding
ids a finite logit far below any real one (``DEAD_LOGIT``): they are picked only where real
candidates run out, and a row holding one (or any id that is not a node of its level) stays
dead. ``dead`` = 2 x the widest beam.

The last level's selection is the model's (:meth:`SIDSteps.final`), not SGLang's: SGLang
scores a candidate by a log-softmax over the logits it is given, so masking the request's
excluded items there would renormalise each row over what is left, while
``SIDDecoder.beam_search`` leaves them out of a distribution over every child (an item's score
is its probability under the decoder). All of a beam's rows run in the same forward, so the
model sees them together and ends the beam exactly as the reference does; without exclusions
SGLang's own last selection is the same (tests/test_sglang_sid.py checks both). A beam with
exclusions is selected by the model at every level (:meth:`SIDSteps.select`, :meth:`SIDSteps.follow`):
the reference drops a prefix all of whose items are left out, which SGLang cannot see.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from genrec.models.sid import SemanticIds
from genrec.models.sid_decoder import SIDDecoder

DEAD_LOGIT = -1e30  # finite (no NaN in a log-softmax), below any real log-probability
MAX_TICKETS = 1 << 14  # prompts kept for beams not yet ended (a lost beam's is dropped, oldest first)


def trie_nodes(sid: SemanticIds) -> list[int]:
    """[L + 1] the trie's nodes at each depth (depth 0: the root; depth L: the items)."""
    return [1] + [int(c.shape[0]) for c in sid.children[1:]] + [int(sid.leaf_item.numel())]


class SIDVocab:
    """The vocabulary SGLang decodes the beams of ``sid``'s trie over (module docstring):
    ``dead`` = 2 x ``max_beam`` padding ids, then the depth-d nodes from ``base[d]``, ``size``
    ids in all, ``levels`` levels. What the engine's front end needs (no decoder there)."""

    def __init__(self, sid: SemanticIds, max_beam: int) -> None:
        self.levels = sid.num_levels
        self.dead = 2 * max_beam
        nodes = trie_nodes(sid)
        self.nodes = nodes  # [L + 1] nodes at each depth (depth 0: the root)
        self.base = [0] * (self.levels + 1)
        self.size = self.dead
        for d in range(1, self.levels + 1):
            self.base[d] = self.size
            self.size += nodes[d]


class SIDSteps(SIDVocab):
    """Example: ``steps = SIDSteps(model.sid_head, max_beam=256)``; a prefill row of a beam
    prompted with h [D] -> ``steps.logits(h[None], torch.tensor([0]), torch.tensor([0]),
    torch.tensor([True]))`` [1, steps.size] (level 0: the root's children)."""

    def __init__(self, head: SIDDecoder, max_beam: int) -> None:
        super().__init__(head.sid, max_beam)
        self.head = head
        sid, nodes = head.sid, self.nodes
        # paths[d] [nodes(d), d]: the codes of each depth-d node
        self.paths = [torch.zeros(1, 0, dtype=torch.long)]
        for level, table in enumerate(sid.children):
            parent, code = (table >= 0).nonzero(as_tuple=True)
            path = torch.empty(nodes[level + 1], level + 1, dtype=torch.long)
            child = table[parent, code]
            path[child, :level] = self.paths[level][parent]
            path[child, level] = code
            self.paths.append(path)
        self.dtype = next(head.parameters()).dtype

    def local(self, tokens: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """[R] each row's node at its level (level 0: the root), -1 where its token is not a
        node of that level (padding, or past the last level)."""
        out = torch.full_like(tokens, -1)
        for level in levels.unique().tolist():
            rows = levels == level
            if level == 0:
                out[rows] = 0
            elif level < self.levels:
                node = tokens[rows] - self.base[level]
                out[rows] = torch.where((node >= 0) & (node < self.nodes[level]), node, torch.full_like(node, -1))
        return out

    def outputs(self, prompts: torch.Tensor, nodes: torch.Tensor, level: int) -> torch.Tensor:
        """The decoder over each row's prompt and codes: [R, level + 1, d] (rows at ``level``,
        prompts [R, D], valid nodes [R])."""
        return self.head.hidden(prompts.to(self.dtype), self.paths[level][nodes])

    @torch.no_grad()
    def logits(self, prompts: torch.Tensor, tokens: torch.Tensor, levels: torch.Tensor, live: torch.Tensor,
               keep: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """SGLang's logits [R, size] for rows holding ``tokens`` [R] at ``levels`` [R] (prompts
        [R, D]; ``live`` [R] False: a row whose beam has no prompt), and for the rows at the
        last level and the rows ``keep`` [R] marks, {row: (node, decoder outputs [level + 1, d])}
        for :meth:`final` and :meth:`select`."""
        r = tokens.numel()
        out = torch.full((r, self.size), -torch.inf)
        nodes = self.local(tokens, levels)
        ok = live & (nodes >= 0)
        out[:, : self.dead] = torch.where(ok, DEAD_LOGIT, 0.0)[:, None]
        last = {}
        for level in levels[ok].unique().tolist():
            rows = (ok & (levels == level)).nonzero().squeeze(1)
            node = nodes[rows]
            hid = self.outputs(prompts[rows], node, level)
            logp = self.head.level_logits(hid[:, level], level, node)  # [r, sizes[level]]
            child = self.head.sid.step(node, level)
            row, code = (child >= 0).nonzero(as_tuple=True)
            out[rows[row], self.base[level + 1] + child[row, code]] = logp[row, code]
            wanted = rows.tolist() if level == self.levels - 1 else [] if keep is None else rows[keep[rows]].tolist()
            at = {int(i): j for j, i in enumerate(rows.tolist())}
            last.update({i: (node[at[i]], hid[at[i]]) for i in wanted})
        return out, last

    def prefix_scores(self, nodes: torch.Tensor, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """The log-probability [R] of each row's prefix (depth-``level`` nodes [R], decoder
        outputs [R, >= level, d]), summed level by level as ``SIDDecoder.beam_search`` sums it."""
        head, sid = self.head, self.head.sid
        codes = self.paths[level][nodes]
        scores = torch.zeros(nodes.numel())
        for depth in range(level):
            logp = head.level_logits(hidden[:, depth], depth, sid.nodes_of(codes[:, :depth]))
            scores = scores + logp.gather(1, codes[:, depth : depth + 1]).squeeze(1)
        return scores

    @torch.no_grad()
    def select(self, nodes: torch.Tensor, hidden: torch.Tensor, level: int, beam: int,
               exhausted) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """An intermediate level of one beam that leaves items out, as ``SIDDecoder.beam_search``
        selects it: its rows' nodes [R] at ``level`` < L-1 and decoder outputs [R, level + 1, d]
        -> the (row, child node) pairs [n] it keeps (n <= beam). A child all of whose items are
        left out (``exhausted``: ``SIDDecoder.exhausted``'s function) is dropped, the others
        keep their probability under the decoder: SGLang's own selection cannot do this (it
        renormalises each row over the logits it gets), so the model picks and SGLang follows."""
        scores = self.prefix_scores(nodes, hidden, level)
        top, row, _, child = self.head.choose(scores[None], hidden[:, level], nodes, level, beam, exhausted)
        keep = torch.isfinite(top[0])
        return row[0][keep], child[0][keep]

    def follow(self, row: torch.Tensor, child: torch.Tensor, level: int, rows: int) -> torch.Tensor:
        """The logits [rows, size] that make SGLang keep exactly the (row, child node) pairs
        :meth:`select` picked (n <= beam <= dead / 2) and nothing else but padding. SGLang scores
        a candidate by its logit minus its row's logsumexp plus its row's sum so far: each
        picked child gets 0 and every padding id of its row log(3/4 - n_row / dead), so that
        its row's logsumexp is log(3/4 dead) whatever n_row is: every pick scores
        log(4/3) - log(dead), its padding less, and every row the beam keeps has the same sum.
        A row without a pick offers only padding at 0: -log(dead), below every pick (its sum
        is theirs). Where picks are fewer than the beam, padding fills it and those rows stay dead."""
        out = torch.full((rows, self.size), -torch.inf)
        out[:, : self.dead] = 0.0
        n = torch.bincount(row, minlength=rows).to(torch.float32)
        has = n > 0
        out[has, : self.dead] = torch.log(0.75 - n[has] / self.dead)[:, None]
        out[row, self.base[level + 1] + child] = 0.0
        return out

    @torch.no_grad()
    def final(self, prompt: torch.Tensor, nodes: torch.Tensor, hidden: torch.Tensor, beam: int,
              exhausted) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
        """The last level of one beam, as ``SIDDecoder.beam_search`` ends it: its rows' nodes
        [R] at level L-1 and decoder outputs [R, L, d] (prompt [D]) -> the ``beam`` best items
        and their log-probabilities, best first, the items ``exhausted`` says are left out
        dropped (without renormalising; None: none), fewer where fewer exist."""
        last = self.levels - 1
        scores = self.prefix_scores(nodes, hidden, last)
        top, _, _, leaf = self.head.choose(scores[None], hidden[:, last], nodes, last, beam, exhausted)
        items = self.head.sid.leaf_item[leaf[0].clamp(min=0)]
        keep = torch.isfinite(top[0]) & (leaf[0] >= 0)
        return items[keep].numpy(), top[0][keep].float().numpy()


@dataclass
class Ticket:
    """What a beam needs besides its rows: the decoder's prompt (the user vector [D]), its width
    and the items it leaves out."""

    prompt: torch.Tensor
    beam: int
    seen: np.ndarray | None
    exhausted: object = None  # SIDDecoder.exhausted's function for ``seen`` (built at first use)


class SIDBeams:
    """The beams in flight in SGLang's scheduler: their prompts by ticket, and one step of any
    mix of their rows (``step``)."""

    def __init__(self, steps: SIDSteps, dim: int) -> None:
        self.steps, self.dim = steps, dim
        self.tickets: OrderedDict[int, Ticket] = OrderedDict()

    def keep(self, ticket: int, prompt: torch.Tensor, beam: int, seen: np.ndarray | None) -> None:
        """Keeps a beam's prompt [D] under its ticket until the beam ends."""
        self.tickets[ticket] = Ticket(prompt, beam, seen)
        while len(self.tickets) > MAX_TICKETS:
            self.tickets.popitem(last=False)

    def _exhausted(self, k: Ticket):  # noqa: ANN202
        """``SIDDecoder.exhausted``'s function for the beam's left-out items (None: none)."""
        if k.exhausted is None and k.seen is not None and k.seen.size:
            seen = torch.from_numpy(k.seen)
            k.exhausted = self.steps.head.exhausted((seen, torch.tensor([seen.numel()])))
        return k.exhausted

    def step(self, tickets: torch.Tensor, tokens: torch.Tensor, levels: torch.Tensor,
             ) -> tuple[torch.Tensor, dict[int, dict]]:
        """Logits [R, vocab] of beam rows (their tickets, tokens and levels [R]), and {row: its
        beam's result} for the rows of beams that end in this pass (each of their rows carries it:
        SGLang reads the leader's). A beam at its last level without a prompt answers ``retry``
        (its ticket was registered after the beam started)."""
        known = [self.tickets.get(t) for t in tickets.tolist()]
        live = torch.tensor([k is not None for k in known], dtype=torch.bool)
        prompts = torch.stack([k.prompt if k is not None else torch.zeros(self.dim) for k in known])
        steps = self.steps
        # rows of beams that leave items out, before their last level: the model selects them
        chosen = torch.tensor([k is not None and k.seen is not None and k.seen.size > 0 for k in known],
                              dtype=torch.bool) & (levels < steps.levels - 1)
        out, rows = steps.logits(prompts, tokens, levels, live, chosen if bool(chosen.any()) else None)
        results: dict[int, dict] = {}
        groups: dict[int, list[int]] = defaultdict(list)
        picks: dict[tuple[int, int], list[int]] = defaultdict(list)
        for row in rows:
            if chosen[row]:
                picks[int(tickets[row]), int(levels[row])].append(row)
            else:
                groups[int(tickets[row])].append(row)
        for (t, level), group in picks.items():
            k = self.tickets[t]
            row, child = steps.select(torch.stack([rows[r][0] for r in group]),
                                      torch.stack([rows[r][1] for r in group]), level, k.beam, self._exhausted(k))
            index = torch.tensor(group)
            out[index] = steps.follow(row, child, level, len(group))
        for t, group in groups.items():
            k = self.tickets.pop(t)
            items, scores = steps.final(k.prompt, torch.stack([rows[r][0] for r in group]),
                                        torch.stack([rows[r][1] for r in group]), k.beam, self._exhausted(k))
            results.update(dict.fromkeys(group, {"items": items.tolist(), "scores": scores.tolist()}))
        for row in ((levels == steps.levels - 1) & ~live).nonzero().squeeze(1).tolist():
            results[row] = {"retry": True}
        return out, results
