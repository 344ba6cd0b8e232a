"""Semantic IDs: each catalogue item as a short code of L tokens, and the trie over the codes.

A generative retrieval head decodes the next item token by token; constraining each step
to the children of the prefix decoded so far (``SemanticIds.step``) makes every finished
beam a real item. The codes come from residual k-means (RQ-KMeans) over item vectors:
level l clusters what levels < l left unexplained, so similar items share prefixes. A last
level numbers the items that still share a whole k-means code, so codes stay unique.

Example (N = 4 items, L = 2 levels, sizes = (2, 2))::

    sid = SemanticIds.from_codes(torch.tensor([3, 7, 8, 9]),
                                 torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]]), (2, 2))
    sid.codes_of(torch.tensor([7, 5]))      # [[0, 1], [-1, -1]]
    sid.items_of(torch.tensor([[1, 0]]))    # [8]
    node = torch.zeros(1, dtype=torch.long)
    nxt = sid.step(node, 0)                 # [1, 2]: child node ids under the root
    sid.leaf_item[sid.step(nxt[:, 1], 1)[:, 0]]   # [8]

The serving process imports this module: only torch, numpy, safetensors and json here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "genrec.semantic_ids/1"
KEYS = ("item_ids", "codes", "sizes")
ASSIGN_ROWS = 1 << 15  # points per distance block in k-means: [rows, k] float32 at a time
# k-means fits its centroids on at most this many points per centroid, drawn at random, then
# assigns every point once (faiss's max_points_per_centroid): at 10^7 items a level costs one
# pass over the table instead of `iters`, and the seeding k passes over 65,536 points, not 10^7
SAMPLE_PER_CENTROID = 256
# a trie level with more entries than this (num_nodes(l) * sizes[l]; 128 MB of int64) is kept
# sparse: SemanticIds.keys
DENSE_TRIE_ENTRIES = 1 << 24


class SemanticIdError(ValueError):
    """Codes that are not a valid codebook (duplicates, out of range) or a damaged file."""


@dataclass(frozen=True, eq=False)
class SemanticIds:
    """Every catalogue item has exactly one code of L levels, every code at most one item.

    ``item_ids`` [N] sorted catalogue; ``codes`` [N, L] (``codes[i]`` is ``item_ids[i]``'s);
    ``sizes`` the vocabulary of each level; ``children[l]`` [num_nodes(l), sizes[l]] the trie:
    the node id at level l+1 of prefix + code, -1 where no item has it. Level 0 is the root
    (node 0); node ids at each level are 0..num_nodes(l)-1, in lexicographic order of their
    prefixes. ``leaf_item`` [num_nodes(L)] = [N]: the item of each full code.

    A level whose table has at most ``DENSE_TRIE_ENTRIES`` entries is dense: ``children[l]``
    holds num_nodes(l) * sizes[l] int64 and ``step`` is one gather. A larger one (at 10^7 items
    the last level: millions of 3-code prefixes x the most items sharing one, tens of GB dense)
    is sparse: ``children[l]`` is empty ([0, sizes[l]]) and ``keys[l]`` [num_nodes(l+1)] holds
    parent * sizes[l] + code of every child, sorted (a child's node id is its position: node
    ids are in that order), so a node's children are one run found by binary search and
    ``step`` scatters the run into a -1 row. Dense levels have ``keys[l] = None``.
    Build with ``from_codes`` (validates); ``to(device)`` moves every tensor.
    """

    item_ids: torch.Tensor
    codes: torch.Tensor
    sizes: tuple[int, ...]
    children: list[torch.Tensor]
    leaf_item: torch.Tensor
    keys: list[torch.Tensor | None] | None = None  # per level; None: every level dense

    @classmethod
    def from_codes(cls, item_ids: torch.Tensor, codes: torch.Tensor, sizes: Sequence[int]) -> SemanticIds:
        """item_ids [N] (any order, unique), codes [N, L], sizes len L -> the codebook and its
        trie; raises SemanticIdError naming the first problem."""
        sizes = tuple(int(s) for s in sizes)
        item_ids, codes = item_ids.long(), codes.long()
        _check(item_ids, codes, sizes)
        item_ids, order = torch.sort(item_ids)
        codes = codes[order].contiguous()
        if bool((item_ids[1:] == item_ids[:-1]).any()):
            dup = int(item_ids[1:][item_ids[1:] == item_ids[:-1]][0])
            raise SemanticIdError(f"item {dup} appears more than once; each item has exactly one code")
        children, keys, node, num = [], [], torch.zeros_like(item_ids), 1
        for level, size in enumerate(sizes):
            # a prefix's node id is the rank of (parent node, code): lexicographic order
            key = node * size + codes[:, level]
            uniq, node = torch.unique(key, return_inverse=True)
            if num * size <= DENSE_TRIE_ENTRIES:
                table = torch.full((num * size,), -1, dtype=torch.long, device=codes.device)
                table[uniq] = torch.arange(uniq.numel(), device=codes.device)
                children.append(table.view(num, size))
                keys.append(None)
            else:
                children.append(torch.empty(0, size, dtype=torch.long, device=codes.device))
                keys.append(uniq)
            num = uniq.numel()
        if num != item_ids.numel():
            _, inv, counts = torch.unique(codes, dim=0, return_inverse=True, return_counts=True)
            shared = item_ids[inv == counts.argmax()]
            raise SemanticIdError(f"{item_ids.numel() - num} codes are shared by more than one item "
                                  f"(e.g. items {shared[:4].tolist()}); every code may name at most one item")
        leaf_item = torch.empty_like(item_ids)
        leaf_item[node] = item_ids
        return cls(item_ids, codes, sizes, children, leaf_item, keys)

    @property
    def num_levels(self) -> int:
        return len(self.sizes)

    def to(self, device: torch.device | str) -> SemanticIds:
        move = lambda t: t.to(device)  # noqa: E731
        return SemanticIds(move(self.item_ids), move(self.codes), self.sizes, [move(c) for c in self.children],
                           move(self.leaf_item), [None if k is None else move(k) for k in self.level_keys])

    @property
    def level_keys(self) -> list[torch.Tensor | None]:
        """``keys`` per level (None: that level is dense)."""
        return self.keys if self.keys is not None else [None] * self.num_levels

    def codes_of(self, items: torch.Tensor) -> torch.Tensor:
        """items [...] -> codes [..., L]; an id not in the catalogue -> a row of -1."""
        flat = items.reshape(-1).long()
        pos = torch.searchsorted(self.item_ids, flat).clamp(max=self.item_ids.numel() - 1)
        hit = self.item_ids[pos] == flat
        out = torch.where(hit[:, None], self.codes[pos], torch.full_like(self.codes[pos], -1))
        return out.reshape(*items.shape, self.num_levels)

    def nodes_of(self, codes: torch.Tensor) -> torch.Tensor:
        """Prefixes codes [..., l] (0 <= l <= L) -> node ids [...] at level l; -1 where no
        item has that prefix (any code out of range included)."""
        lead, depth = codes.shape[:-1], codes.shape[-1]
        if depth > self.num_levels:
            raise ValueError(f"a prefix of {depth} codes is longer than the {self.num_levels} levels")
        flat = codes.reshape(math.prod(lead), depth).long()
        node = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
        for level in range(depth):
            c, size = flat[:, level], self.sizes[level]
            ok = (node >= 0) & (c >= 0) & (c < size)
            nxt = self._child(level, node.clamp(min=0), c.clamp(0, size - 1))
            node = torch.where(ok, nxt, torch.full_like(nxt, -1))
        return node.reshape(lead)

    def items_of(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., L] -> item ids [...]; -1 where no item has that code."""
        if codes.shape[-1] != self.num_levels:
            raise ValueError(f"codes have {codes.shape[-1]} levels, the codebook {self.num_levels}")
        node = self.nodes_of(codes)
        return torch.where(node >= 0, self.leaf_item[node.clamp(min=0)], torch.full_like(node, -1))

    def step(self, nodes: torch.Tensor, level: int) -> torch.Tensor:
        """nodes [K] at ``level`` (valid ids, >= 0) -> [K, sizes[level]] child node ids at
        level + 1, -1 where the code is not allowed. One gather (a negative node is an
        index error, not a silent wrap to the last node)."""
        keys, size = self.level_keys[level], self.sizes[level]
        if keys is None:
            return self.children[level].index_select(0, nodes.reshape(-1)).reshape(*nodes.shape, size)
        flat = nodes.reshape(-1)
        if bool((flat < 0).any()):
            raise IndexError(f"step: negative node id at level {level}")
        lo = torch.searchsorted(keys, flat * size)
        count = torch.searchsorted(keys, (flat + 1) * size) - lo
        row = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), count)
        child = torch.arange(row.numel(), device=flat.device) - torch.repeat_interleave(
            count.cumsum(0) - count, count) + lo[row]
        out = torch.full((flat.numel(), size), -1, dtype=torch.long, device=flat.device)
        out[row, keys[child] - flat[row] * size] = child
        return out.reshape(*nodes.shape, size)

    def _child(self, level: int, node: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """The child node id of each node [P] (>= 0) with code [P] (in range) at ``level``, -1 where none."""
        keys = self.level_keys[level]
        if keys is None:
            return self.children[level][node, code]
        want = node * self.sizes[level] + code
        pos = torch.searchsorted(keys, want).clamp(max=keys.numel() - 1)
        return torch.where(keys[pos] == want, pos, torch.full_like(pos, -1))

    def stats(self) -> dict[str, Any]:
        """How the codebook uses its codes. ``collision_rate``: fraction of items whose first
        L-1 codes another item shares (what the last level has to break); ``max_collisions``:
        the most items sharing the first L-1 codes (1: none); ``used_per_level``: distinct
        codes used / sizes[l]; ``perplexity_per_level``: exp(entropy) of level l's code
        distribution (equals the number of codes used when they are used evenly)."""
        n, levels = self.codes.shape
        codes = self.codes.cpu()
        if levels > 1:
            inv, counts = unique_rows(codes[:, :-1])
            shared = counts[inv] > 1
        else:
            counts, shared = torch.tensor([n]), torch.full((n,), n > 1)
        used, perplexity = [], []
        for level, size in enumerate(self.sizes):
            p = torch.bincount(codes[:, level], minlength=size).double() / n
            p = p[p > 0]
            used.append(p.numel() / size)
            perplexity.append(math.exp(float(-(p * p.log()).sum())))
        return {"items": n, "levels": levels, "sizes": list(self.sizes),
                "collision_rate": float(shared.double().mean()), "max_collisions": int(counts.max()),
                "used_per_level": used, "perplexity_per_level": perplexity}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a file or checkpoint stores; the trie is rebuilt from it."""
        return {"item_ids": self.item_ids, "codes": self.codes,
                "sizes": torch.tensor(self.sizes, dtype=torch.long, device=self.codes.device)}

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> SemanticIds:
        missing = [k for k in KEYS if k not in sd]
        if missing:
            raise SemanticIdError(f"semantic-ID state lacks {missing} (has {sorted(sd)})")
        if sd["sizes"].dim() != 1:
            raise SemanticIdError(f"semantic-ID 'sizes' must be 1-D, got shape {list(sd['sizes'].shape)}")
        return cls.from_codes(sd["item_ids"], sd["codes"], sd["sizes"].tolist())

    def save(self, path: str | Path) -> None:
        """One safetensors file; its metadata holds the format and ``stats()`` as JSON."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": FORMAT, "stats": json.dumps(self.stats())})

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> SemanticIds:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                fmt = (f.metadata() or {}).get("format")
                sd = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise SemanticIdError(f"{path}: not a readable safetensors file ({e})") from e
        if fmt != FORMAT:
            raise SemanticIdError(f"{path}: format {fmt!r}, expected {FORMAT!r} (a file written by 'genrec sid build')")
        return cls.from_state_dict(sd).to(device)


def _check(item_ids: torch.Tensor, codes: torch.Tensor, sizes: tuple[int, ...]) -> None:
    if item_ids.dim() != 1 or codes.dim() != 2 or codes.shape[0] != item_ids.shape[0]:
        raise SemanticIdError(f"item_ids must be [N] and codes [N, L]; got {list(item_ids.shape)} and "
                              f"{list(codes.shape)}")
    if item_ids.numel() == 0:
        raise SemanticIdError("no items: a codebook needs at least one")
    if codes.shape[1] != len(sizes) or not sizes or min(sizes) < 1:
        raise SemanticIdError(f"sizes {list(sizes)} must give each of the {codes.shape[1]} levels at least one code")
    bad = (codes < 0) | (codes >= torch.tensor(sizes, device=codes.device))
    if bool(bad.any()):
        row, level = (int(v) for v in bad.nonzero()[0])
        raise SemanticIdError(f"item {int(item_ids[row])}: code {int(codes[row, level])} at level {level} is outside "
                              f"[0, {sizes[level]})")


def _kmeans_pp(x: torch.Tensor, xx: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: x [N, D], xx [N] squared norms -> centroids [k', D], k' <= k (fewer
    when x has fewer than k distinct points)."""
    first = int(torch.randint(x.shape[0], (1,), generator=gen))
    cent, tol = [x[first]], _tolerance(xx)
    d2 = _dist_to(x, xx, first, tol)
    for _ in range(1, k):
        cdf = d2.double().cumsum(0)
        if cdf[-1] <= 0:
            break
        u = torch.rand(1, generator=gen, dtype=torch.float64).to(cdf.device)
        i = int(torch.searchsorted(cdf, u * cdf[-1]))
        i = min(i, x.shape[0] - 1)
        cent.append(x[i])
        d2 = torch.minimum(d2, _dist_to(x, xx, i, tol))
    return torch.stack(cent)


def _tolerance(xx: torch.Tensor) -> float:
    # |x|^2 - 2 x.c + |c|^2 cancels to a few float32 ulps of the norms, not to 0, when x == c:
    # distances below this count as 0 (so duplicates are never drawn as new seeds)
    return 1e-6 * float(xx.max()) if xx.numel() else 0.0


def _dist_to(x: torch.Tensor, xx: torch.Tensor, i: int, tol: float) -> torch.Tensor:
    """Squared distances [N] from every point to point i (a mat-vec: on a busy machine this is
    many times faster than the elementwise (x - x[i])^2)."""
    d = xx - 2 * (x @ x[i]) + xx[i]
    return d.masked_fill(d <= tol, 0.0)


def _sq_norms(x: torch.Tensor) -> torch.Tensor:
    """x [N, D] -> squared row norms [N], in blocks (x.square() whole is another [N, D])."""
    return torch.cat([x[i : i + ASSIGN_ROWS].square().sum(1) for i in range(0, x.shape[0], ASSIGN_ROWS)])


def _sq_dist(x: torch.Tensor, xx: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """x [n, D], xx [n] its squared norms, cent [k, D] -> squared distances [n, k]."""
    return torch.addmm(cent.square().sum(1), x, cent.T, alpha=-2).add_(xx[:, None]).clamp_min_(0)


def _balanced_assign(d: torch.Tensor) -> torch.Tensor:
    """d [N, k] -> assignment [N] with cluster sizes N // k or N // k + 1: cluster j in turn
    takes its nearest points not yet taken (the greedy scheme of balanced RQ-KMeans)."""
    n, k = d.shape
    assign = torch.full((n,), -1, dtype=torch.long, device=d.device)
    taken = torch.zeros(n, dtype=torch.bool, device=d.device)
    for j in range(k):
        cap = n // k + (j < n % k)
        if cap == 0:
            break
        idx = d[:, j].masked_fill(taken, math.inf).topk(cap, largest=False).indices
        assign[idx] = j
        taken[idx] = True
    return assign


def _assign(x: torch.Tensor, xx: torch.Tensor, cent: torch.Tensor, balanced: bool,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest (or balanced) centroid of each point and its squared distance: [N], [N]."""
    if balanced:
        d = _sq_dist(x, xx, cent)
        a = _balanced_assign(d)
        return a, d.gather(1, a[:, None]).squeeze(1)
    cc, codes, dist = cent.square().sum(1), [], []
    for i in range(0, x.shape[0], ASSIGN_ROWS):
        # |x|^2 is the same for every centroid: the argmin needs only |c|^2 - 2 x.c
        m = torch.addmm(cc, x[i : i + ASSIGN_ROWS], cent.T, alpha=-2).min(1)
        codes.append(m.indices)
        dist.append((m.values + xx[i : i + ASSIGN_ROWS]).clamp_min(0))
    return torch.cat(codes), torch.cat(dist)


def kmeans(x: torch.Tensor, k: int, iters: int = 30, gen: torch.Generator | None = None,
           balanced: bool = False, sample_per_centroid: int = SAMPLE_PER_CENTROID,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means from k-means++ seeds: x [N, D] -> (codes [N] in [0, k'), centroids
    [k', D]), k' = min(k, distinct points). The centroids are the means of the returned
    clusters (so the residual x - centroids[codes] has no larger norm than x). An emptied
    cluster is re-seeded at the point farthest from its centroid.

    Above ``k * sample_per_centroid`` points (0: never) the centroids are fitted on that many
    points drawn without replacement (``gen``), then every point is assigned once, in blocks,
    and the centroids become its clusters' means: the same contract, one pass over x instead
    of ``iters``. Balanced k-means is never sampled (its assignment needs all points at once)."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    cap = k * sample_per_centroid
    if not balanced and sample_per_centroid > 0 and x.shape[0] > cap:
        pick = torch.randperm(x.shape[0], generator=gen)[:cap].sort().values.to(x.device)
        _, cent = kmeans(x[pick], k, iters, gen, balanced=False, sample_per_centroid=0)
        codes, _ = _assign(x, _sq_norms(x), cent, balanced=False)
        counts = torch.bincount(codes, minlength=cent.shape[0])
        means = torch.zeros_like(cent).index_add_(0, codes, x) / counts.clamp_min(1)[:, None]
        return codes, torch.where((counts > 0)[:, None], means, cent)
    xx = _sq_norms(x)
    cent = _kmeans_pp(x, xx, min(k, x.shape[0]), gen)
    k, prev, tol = cent.shape[0], None, _tolerance(xx)
    for _ in range(max(1, iters)):
        codes, dist = _assign(x, xx, cent, balanced)
        counts = torch.bincount(codes, minlength=k)
        means = torch.zeros_like(cent).index_add_(0, codes, x) / counts.clamp_min(1)[:, None]
        if prev is not None and torch.equal(codes, prev):
            break
        prev, empty = codes, (counts == 0).nonzero().squeeze(1)
        cent = torch.where((counts > 0)[:, None], means, cent)
        if empty.numel():
            far = dist.topk(min(empty.numel(), dist.numel())).indices
            far = far[dist[far] > tol]  # a point on its centroid would only duplicate it
            cent[empty[: far.numel()]] = x[far]
    return codes, means


def rq_kmeans(x: torch.Tensor, sizes: Sequence[int], iters: int = 30, seed: int = 0,
              balanced: bool = False, sample_per_centroid: int = SAMPLE_PER_CENTROID) -> torch.Tensor:
    """Residual k-means: x [N, D] -> codes [N, len(sizes)], codes[:, l] in [0, sizes[l]).

    Level l clusters the residual left by levels < l into (at most) sizes[l] centroids.
    Deterministic for a seed on CPU (each level seeds its own generator; on a GPU the
    centroid sums use atomics). ``balanced`` gives each
    cluster N // k or N // k + 1 points (OneRec's scheme, for even codebook use).
    Default plain (a validated choice): on the item tables of two ML-1M runs (3,706 x 64;
    levels 32, 64 and 256 three times; seeds 0 and 1) balanced used each level's codes
    evenly (perplexity = size, against 0.15-1x for plain) but left more residual at every
    level and shared whole codes between more items: 64,64,64 put 6-14% of items on a
    shared code against 1-4%, up to 13-17 items on one code against 2-4. Its greedy order
    hands the last clusters the leftover outliers, level after level, so outliers collide.
    Both used every code of every level. ``sample_per_centroid``: see :func:`kmeans`.
    """
    return _rq_kmeans_(x.float().clone(), sizes, iters, seed, balanced, sample_per_centroid)


def _rq_kmeans_(r: torch.Tensor, sizes: Sequence[int], iters: int, seed: int, balanced: bool,
                sample_per_centroid: int) -> torch.Tensor:
    """rq_kmeans on r [N, D] float32, which it overwrites with the residuals (no copy: 2.56 GB
    at 10^7 x 64)."""
    out = torch.empty(r.shape[0], len(sizes), dtype=torch.long, device=r.device)
    for level, size in enumerate(sizes):
        gen = torch.Generator(device="cpu").manual_seed(seed * 1000003 + level)
        codes, cent = kmeans(r, int(size), iters, gen, balanced, sample_per_centroid)
        out[:, level] = codes
        for i in range(0, r.shape[0], ASSIGN_ROWS):  # in blocks: cent[codes] whole is another [N, D]
            r[i : i + ASSIGN_ROWS] -= cent[codes[i : i + ASSIGN_ROWS]]
    return out


def _row_keys(codes: torch.Tensor) -> torch.Tensor | None:
    """codes [N, l] (non-negative) -> one int64 per row, in the rows' lexicographic order (mixed
    radix over each column's max + 1), or None where that does not fit 63 bits. ``torch.unique``
    of these is that of the rows (``dim=0``), without sorting [N, l] rows: seconds at 10^7."""
    key = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
    span = 1
    for col in codes.unbind(1):
        base = int(col.max()) + 1 if col.numel() else 1
        span *= base
        if span >= 1 << 62:
            return None
        key = key * base + col
    return key


def unique_rows(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, l] -> (inverse [N], counts [U]) as ``torch.unique(codes, dim=0, ...)`` gives."""
    key = _row_keys(codes)
    if key is None:
        _, inv, counts = torch.unique(codes, dim=0, return_inverse=True, return_counts=True)
        return inv, counts
    _, inv, counts = torch.unique(key, return_inverse=True, return_counts=True)
    return inv, counts


def collision_level(codes: torch.Tensor) -> tuple[torch.Tensor, int]:
    """codes [N, l] in item order -> (rank [N] of each item among the items with its code,
    0, 1, 2, ... in that order; the largest number of items sharing a code)."""
    inv, counts = unique_rows(codes)
    order = torch.argsort(inv, stable=True)
    start = counts.cumsum(0) - counts
    rank = torch.empty_like(inv)
    rank[order] = torch.arange(inv.numel(), device=inv.device) - start[inv[order]]
    return rank, int(counts.max())


def build_semantic_ids(item_ids: torch.Tensor, vectors: torch.Tensor, sizes: Sequence[int] = (256, 256, 256),
                       iters: int = 30, seed: int = 0, balanced: bool = False,
                       sample_per_centroid: int = SAMPLE_PER_CENTROID, inplace: bool = False) -> SemanticIds:
    """item_ids [N], vectors [N, D] -> codes of len(sizes) + 1 levels: RQ-KMeans over the
    L2-normalised vectors, then a last level numbering the items that share those codes
    (its size: the most items sharing one, at least 1). Every item gets exactly one code.
    Holds one [N, D] float32 copy of ``vectors`` beside them (the residuals); ``inplace``: none,
    ``vectors`` (float32, item_ids sorted) is overwritten with them instead."""
    item_ids, order = torch.sort(item_ids.long())
    x = vectors.float() if bool((order == torch.arange(order.numel())).all()) else vectors[order].float()
    x = x.clone() if x.data_ptr() == vectors.data_ptr() and not inplace else x
    for i in range(0, x.shape[0], ASSIGN_ROWS):
        x[i : i + ASSIGN_ROWS] /= torch.linalg.vector_norm(x[i : i + ASSIGN_ROWS], dim=1, keepdim=True).clamp_min(1e-12)
    rq = _rq_kmeans_(x, sizes, iters, seed, balanced, sample_per_centroid)
    del x
    last, width = collision_level(rq)
    codes = torch.cat([rq, last[:, None]], 1)
    return SemanticIds.from_codes(item_ids, codes, (*(int(s) for s in sizes), width))
