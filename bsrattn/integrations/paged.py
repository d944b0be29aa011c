"""A paged KV cache for a serving loop: one page pool per layer, a page table per request, layouts on demand.

A serving engine stores every request's keys and values in fixed-size pages of one pool, handed out as
requests grow and taken back when they leave, so a request's pages end up anywhere in the pool. In bsrattn's
terms that pool is a KV storage of ``num_pages`` blocks of ``page_size`` slots (NHD: ``[num_pages, page_size,
num_kv_heads, head_dim]`` per layer), and a step's requests are one BSR layout over it: ``Bc = page_size``, the
page tables its block indices (:func:`bsrattn.layouts.paged`). A prefix every request shares, a system prompt,
is stored once, in pages of its own, and a step over requests that all continue it is a two-level
:class:`~bsrattn.Cascade` (:func:`bsrattn.layouts.shared_prefix`): the prefix's pages are read once for all
of them.

The cache only keeps the books (which pages, how many tokens) and the tensors; the model writes the new
tokens' keys and values into it (:meth:`PagedKVCache.write`) at the slots :meth:`PagedKVCache.extend` gives
out, and attends with :class:`~bsrattn.BatchAttention` over :meth:`PagedKVCache.layout`. Speculative decoding
takes a step's :meth:`PagedKVCache.tree` layout and keeps an accepted branch (:meth:`PagedKVCache.keep`);
Quest's per-head page selection reads a pool stored HND through :meth:`PagedKVCache.quest`. The serving loop
of ``examples/paged_generation.py`` drives a transformers model this way. Needs torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

try:
    import torch
except ImportError as err:
    raise ImportError("bsrattn.integrations.paged needs torch: pip install 'bsrattn[torch]'") from err

from bsrattn import layouts
from bsrattn.indexing import ceil_div
from bsrattn.cascade import Cascade
from bsrattn.coerce import as_int, as_lengths
from bsrattn.layout import BSRLayout

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Pages of keys and values for every layer, and the page table and length of every request.

    Parameters
    ----------
    num_layers, num_pages, page_size, num_kv_heads, head_dim : int
        The pool: ``k[layer]`` and ``v[layer]`` are ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD).
    dtype : torch.dtype
        Of the stored keys and values.
    device : torch.device or str
        Where the pool lives.
    kv_layout : str
        ``"NHD"``, or ``"HND"`` (``[num_pages, num_kv_heads, page_size, head_dim]`` per layer), which Quest's
        per-head page selection reads (:meth:`quest`); plan with the same ``kv_layout``.

    Examples
    --------
    >>> import torch
    >>> cache = PagedKVCache(num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=8)
    >>> cache.extend("a", 3).tolist(), cache.extend("b", 1).tolist(), cache.extend("a", 1).tolist()
    ([0, 1, 2], [4], [3])
    >>> cache.layout(["a", "b"], [1, 1]).kv_lens.tolist()
    [4, 1]
    >>> cache.close("a"); cache.free_pages
    3
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_layout: str = "NHD") -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self.kv_layout = kv_layout
        self.num_pages = as_int("num_pages", num_pages, minimum=1)
        self.page_size = as_int("page_size", page_size, minimum=1)
        self.num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
        slots = (self.page_size, self.num_kv_heads) if kv_layout == "NHD" else (self.num_kv_heads, self.page_size)
        shape = (as_int("num_layers", num_layers, minimum=1), self.num_pages, *slots,
                 as_int("head_dim", head_dim, minimum=1))
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: pages 0, 1, 2, ... first
        self._pages: dict = {}  # request -> its pages, in order
        self._lengths: dict = {}  # request -> tokens stored
        self._prefix: dict = {}  # request -> the request whose tokens it continues (shared, stored once)

    @property
    def free_pages(self) -> int:
        """Pages no request holds."""
        return len(self._free)

    def __contains__(self, request: Hashable) -> bool:
        return request in self._lengths

    def length(self, request: Hashable) -> int:
        """Tokens of ``request`` in the cache, its shared prefix's included.

        Parameters
        ----------
        request : hashable
            An open request.

        Returns
        -------
        int
        """
        own = self._lengths[request]
        prefix = self._prefix.get(request)
        return own + (0 if prefix is None else self.length(prefix))

    def open(self, request: Hashable, prefix: Hashable | None = None) -> None:
        """Start ``request``, empty, or continuing the tokens of the request ``prefix`` (stored once, not copied:
        its pages become the first level of every :meth:`cascade` over its continuations).

        Parameters
        ----------
        request : hashable
            Its name, not yet in the cache.
        prefix : hashable, optional
            An open request whose tokens this one continues.
        """
        if request in self._lengths:
            raise ValueError(f"request {request!r} is already in the cache")
        if prefix is not None and prefix not in self._lengths:
            raise ValueError(f"prefix {prefix!r} is not in the cache")
        self._pages[request], self._lengths[request] = [], 0
        if prefix is not None:
            self._prefix[request] = prefix

    def extend(self, request: Hashable, num_tokens: int) -> torch.Tensor:
        """Room for ``num_tokens`` more tokens of ``request`` (opened if new): their pool slots (``page *
        page_size + offset``), int64, in order.

        Parameters
        ----------
        request : hashable
            The request that grows.
        num_tokens : int
            How many tokens it adds.

        Returns
        -------
        torch.Tensor, ``[num_tokens]`` int64
            The new tokens' pool slots.

        Raises
        ------
        RuntimeError
            The pool has too few free pages (nothing is taken then).
        """
        num_tokens = as_int("num_tokens", num_tokens, minimum=0)
        if request not in self._lengths:
            self.open(request)
        pages, start = self._pages[request], self._lengths[request]
        need = ceil_div(start + num_tokens, self.page_size) - len(pages)
        if need > len(self._free):
            raise RuntimeError(f"request {request!r} needs {need} more pages; the pool has {len(self._free)} free "
                               f"of {self.num_pages}")
        pages.extend(self._free.pop() for _ in range(need))
        self._lengths[request] = start + num_tokens
        return self._slots(request, range(start, start + num_tokens))

    def _slots(self, request, positions) -> torch.Tensor:
        """Pool slots of ``request``'s own tokens at ``positions``, int64 (in NumPy, whose calls on a few
        elements cost a fraction of torch's: a decode step makes one per request)."""
        table = np.asarray(self._pages[request], dtype=np.int64)
        at = np.asarray(positions, dtype=np.int64)
        return torch.from_numpy(table[at // self.page_size] * self.page_size + at % self.page_size)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values of one layer at their slots.

        Parameters
        ----------
        layer : int
            The layer whose pool is written.
        slots : torch.Tensor, ``[n]``
            Pool slots, as :meth:`extend` gave them.
        k, v : torch.Tensor, ``[n, num_kv_heads, head_dim]``
            The tokens' keys and values.
        """
        # Compiled, one op writing in place: a traced store is a functional update of the whole pool, copied.
        store = torch.ops.bsrattn.paged_kv_write if torch.compiler.is_compiling() else _store
        for pool, x in ((self.k, k), (self.v, v)):
            at = slots.to(pool.device)
            store(pool, layer, at // self.page_size, at % self.page_size, x.to(pool.dtype), self.kv_layout == "HND")

    def _at(self, slots: torch.Tensor) -> tuple:
        """The index of ``slots`` in a layer's pool: its ``[n, num_kv_heads, head_dim]`` elements."""
        return _index(slots // self.page_size, slots % self.page_size, self.kv_layout == "HND")

    def keep(self, request: Hashable, start: int, offsets: Sequence[int]) -> None:
        """Keep, of ``request``'s tokens from ``start`` on, those at ``start + offsets[j]`` as its tokens ``start +
        j``, in every layer, and drop the rest (their pages go back to the pool): a draft tree's accepted path
        becomes the request's next tokens.

        Parameters
        ----------
        request : hashable
            An open request, with no shared prefix or with ``start`` past it.
        start : int
            The request's own token where the kept run begins.
        offsets : sequence of int
            Increasing offsets from ``start`` of the tokens kept, the first 0 or more.
        """
        start = as_int("start", start, minimum=0)
        offsets = [as_int("offsets", o, minimum=0) for o in offsets]
        length = self._lengths[request]
        if any(b <= a for a, b in zip(offsets, offsets[1:])) or (offsets and start + offsets[-1] >= length):
            raise ValueError(f"offsets {offsets} must increase and stay below the request's {length - start} "
                             f"tokens after start {start}")
        src = self._slots(request, [start + o for o in offsets])
        dst = self._slots(request, range(start, start + len(offsets)))
        for pool in (self.k, self.v):
            for layer in range(pool.shape[0]):  # the sources are gathered first, so none is overwritten early
                pool[(layer, *self._at(dst.to(pool.device)))] = pool[(layer, *self._at(src.to(pool.device)))]
        self._lengths[request] = start + len(offsets)
        keep_pages = ceil_div(self._lengths[request], self.page_size)
        self._free.extend(reversed(self._pages[request][keep_pages:]))
        del self._pages[request][keep_pages:]

    def close(self, request: Hashable) -> None:
        """Take ``request``'s own pages back; a prefix others continue is kept until they are closed too.

        Parameters
        ----------
        request : hashable
            An open request that no open request continues.
        """
        if any(p == request for p in self._prefix.values()):
            raise ValueError(f"request {request!r} is the shared prefix of open requests; close them first")
        self._free.extend(reversed(self._pages.pop(request)))
        del self._lengths[request]
        self._prefix.pop(request, None)

    def layout(self, requests: Sequence[Hashable], qo_lens: Sequence[int]) -> BSRLayout:
        """The paged layout of ``requests`` (each with no shared prefix) whose last ``qo_lens`` tokens query.

        Parameters
        ----------
        requests : sequence of hashable
            The step's requests, in the order of its query rows.
        qo_lens : sequence of int
            Each one's query rows: its last tokens (a prefill's prompt, a decode's one token).

        Returns
        -------
        BSRLayout
            :func:`bsrattn.layouts.paged` over the requests' page tables and lengths.
        """
        for r in requests:
            if r in self._prefix:
                raise ValueError(f"request {r!r} continues a shared prefix: use cascade()")
        # The books' page tables hold exactly the pages their lengths fill, so they are the layout's indices as
        # they stand: concatenated at once, not checked row by row as layouts.paged checks a caller's.
        qo_lens = as_lengths("qo_lens", qo_lens, len(requests), "requests")
        lengths = np.fromiter((self._lengths[r] for r in requests), np.int64, len(requests))
        indices = np.fromiter(itertools.chain.from_iterable(self._pages[r] for r in requests), np.int64)
        return layouts._paged_layout(qo_lens, lengths, indices, self.page_size, self.num_pages)

    def tree(self, requests: Sequence[Hashable], parents: Sequence[Sequence[int]]) -> BSRLayout:
        """The tree layout of ``requests`` (each with no shared prefix) whose last ``len(parents[b])`` tokens are
        draft-tree nodes (a prompt is a chain: ``[-1, 0, 1, ...]``), each attending its ancestors and itself.

        Parameters
        ----------
        requests : sequence of hashable
            The step's requests, in the order of its query rows.
        parents : sequence of sequences of int
            Each one's tree, as :func:`bsrattn.layouts.tree` takes it.

        Returns
        -------
        BSRLayout
            :func:`bsrattn.layouts.tree` over the requests' page tables and lengths.
        """
        for r in requests:
            if r in self._prefix:
                raise ValueError(f"request {r!r} continues a shared prefix: trees over a cascade are not supported")
        return layouts.tree(parents, [self._pages[r] for r in requests], [self._lengths[r] for r in requests],
                            self.page_size, self.num_pages)

    def pages(self, request: Hashable) -> list:
        """The pool pages of ``request``'s own tokens, in order.

        Parameters
        ----------
        request : hashable
            An open request.

        Returns
        -------
        list of int
        """
        return list(self._pages[request])

    def quest(self, requests: Sequence[Hashable], selected_pages: Sequence[Sequence[Sequence[int]]]) -> BSRLayout:
        """The Quest layout of one decode query per request: each KV head reads only its selected pages.

        Parameters
        ----------
        requests : sequence of hashable
            The step's decoding requests (no shared prefix), one query each.
        selected_pages : nested sequence of int, ``[B][num_kv_heads][budget]``
            Each head's pages, as positions in the request's page table, increasing (the partial last page last).

        Returns
        -------
        BSRLayout
            :func:`bsrattn.layouts.quest`, over the HND pool viewed per head
            (:func:`bsrattn.layouts.per_head_views`).
        """
        if self.kv_layout != "HND":
            raise ValueError("Quest reads the pool per head: make the cache with kv_layout='HND'")
        for r in requests:
            if r in self._prefix:
                raise ValueError(f"request {r!r} continues a shared prefix: Quest over a cascade is not supported")
        return layouts.quest([self._pages[r] for r in requests], [self._lengths[r] for r in requests],
                             selected_pages, self.page_size, self.num_pages, self.num_kv_heads)

    def cascade(self, prefix: Hashable, requests: Sequence[Hashable], qo_lens: Sequence[int]) -> Cascade:
        """The two-level layout of ``requests``, all continuing ``prefix``, whose last ``qo_lens`` tokens query:
        the prefix's pages once for every query, then each request's own pages.

        Parameters
        ----------
        prefix : hashable
            The request they all continue (itself continuing none).
        requests : sequence of hashable
            The step's requests, in the order of its query rows.
        qo_lens : sequence of int
            Each one's query rows.

        Returns
        -------
        Cascade
            :func:`bsrattn.layouts.shared_prefix`: the prefix level, then the requests' own pages.
        """
        for r in requests:
            if self._prefix.get(r) != prefix:
                raise ValueError(f"request {r!r} does not continue the prefix {prefix!r}")
        if prefix in self._prefix:
            raise ValueError(f"the prefix {prefix!r} continues another prefix; one level of sharing is supported")
        return layouts.shared_prefix(qo_lens, self._pages[prefix], self._lengths[prefix],
                                     [self._pages[r] for r in requests], [self._lengths[r] for r in requests],
                                     self.page_size, self.num_pages)


def _index(page, offset, hnd) -> tuple:
    """The index of slots ``(page, offset)`` in a layer's pool, ``[pages, page_size, H, D]`` or, with ``hnd``,
    ``[pages, H, page_size, D]``: their ``[n, num_kv_heads, head_dim]`` elements."""
    return (page, slice(None), offset) if hnd else (page, offset)


def _store(pool, layer, page, offset, x, hnd):
    """``pool[layer]``'s slots ``(page, offset)`` set to ``x [n, num_kv_heads, head_dim]``."""
    pool[(layer, *_index(page, offset, hnd))] = x


@torch.library.custom_op("bsrattn::paged_kv_write", mutates_args=("pool",))
def _paged_kv_write(pool: torch.Tensor, layer: int, page: torch.Tensor, offset: torch.Tensor, x: torch.Tensor,
                    hnd: bool) -> None:
    """:meth:`PagedKVCache.write` of one pool as an op that ``torch.compile`` keeps whole and in place."""
    _store(pool, layer, page, offset, x, hnd)


@_paged_kv_write.register_fake
def _(pool, layer, page, offset, x, hnd):
    return None
