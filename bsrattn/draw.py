"""Pictures: a layout as its BSR matrix, a plan as a Gantt chart of CTAs, read amplification against block size.

Needs matplotlib (``pip install 'bsrattn[draw]'``), which is imported here and nowhere else in bsrattn:
``import bsrattn`` does not bring it in, ``import bsrattn.draw`` does. Each function draws into the Axes it is
given (``ax=``), or into a new figure, and returns the :class:`~matplotlib.figure.Figure`, so a notebook can lay
out its own subplots. Block row (request) ``r`` has colour ``r % 10`` of :data:`PALETTE` in every picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

try:
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator
except ImportError as err:
    raise ImportError("bsrattn.draw needs matplotlib: pip install 'bsrattn[draw]'") from err

from bsrattn.indexing import ceil_div
from bsrattn.cascade import Cascade
from bsrattn.layout import BSRLayout

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from bsrattn.scheduler import WorkPlan
    from bsrattn.variant import Variant

__all__ = ["layout", "plan", "read_amplification", "PALETTE"]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
"""Tableau's ten categorical colours: block row ``r`` is ``PALETTE[r % 10]``."""

_BOX = dict(facecolor="0.5", alpha=0.2, edgecolor="0.2", linewidth=1.0)


def _axes(ax, count=1, figsize=None):
    """``(figure, [Axes] * count)``: the given Axes (one, or a sequence of ``count``), else a new row of them."""
    if ax is None:
        fig, axes = plt.subplots(1, count, figsize=figsize, squeeze=False, layout="constrained")
        return fig, list(axes[0])
    axes = [ax] if count == 1 and not isinstance(ax, (list, tuple, np.ndarray)) else list(np.ravel(ax))
    if len(axes) != count:
        raise ValueError(f"ax: {count} Axes needed, {len(axes)} given")
    return axes[0].figure, axes


def _row_owner(lay: BSRLayout) -> np.ndarray:
    """``[nnz_qo]``: the block row each query row belongs to."""
    return np.repeat(np.arange(lay.num_rows), lay.qo_lens)


def _runs(slots: np.ndarray) -> list:
    """Consecutive runs of ``slots`` (sorted by position, not value): one array per run."""
    return np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1)


def _block_boxes(lay: BSRLayout) -> list:
    """``(x0, y0, width, height)`` of every stored block: row ``r``'s ``kv_indices[j]``, Bc wide, ``qo_len`` tall."""
    boxes = []
    for r in range(lay.num_rows):
        qs, qe = int(lay.qo_indptr[r]), int(lay.qo_indptr[r + 1])
        if qe == qs:
            continue
        for b in lay.kv_indices[lay.kv_indptr[r]:lay.kv_indptr[r + 1]]:
            boxes.append((int(b) * lay.block_size, qs, lay.block_size, qe - qs))
    return boxes


def _tile_boxes(lay: BSRLayout, mask: np.ndarray, tile_rows: int, tile_cols: int, grid: str) -> list:
    """``(x0, y0, width, height)`` of every tile holding a visible pair of ``mask`` (``[nnz_qo, num_slots]``)."""
    boxes = []
    if grid == "pool":
        rows, cols = ceil_div(mask.shape[0], tile_rows), ceil_div(mask.shape[1], tile_cols)
        padded = np.zeros((rows * tile_rows, cols * tile_cols), dtype=bool)
        padded[:mask.shape[0], :mask.shape[1]] = mask
        occupied = padded.reshape(rows, tile_rows, cols, tile_cols).any(axis=(1, 3))
        return [(int(j) * tile_cols, int(i) * tile_rows, tile_cols, tile_rows) for i, j in zip(*np.nonzero(occupied))]
    if grid != "row":
        raise ValueError(f"tile_grid must be 'row' or 'pool', got {grid!r}")
    for r in range(lay.num_rows):
        qs, qe = int(lay.qo_indptr[r]), int(lay.qo_indptr[r + 1])
        slots = lay.kv_slots(r)
        visible = mask[qs:qe][:, slots]                             # [qo_len, kv_len], logical key order
        for q0 in range(0, qe - qs, tile_rows):
            height = min(tile_rows, qe - qs - q0)
            for k0 in range(0, slots.size, tile_cols):
                if visible[q0:q0 + tile_rows, k0:k0 + tile_cols].any():
                    boxes += [(int(run[0]), qs + q0, run.size, height) for run in _runs(slots[k0:k0 + tile_cols])]
    return boxes


def _draw_bsr(ax, lay: BSRLayout, variant, tiles, tile_grid, title):
    mask = lay.to_dense_mask(variant)                               # [nnz_qo, num_slots]
    image = np.where(mask, _row_owner(lay)[:, None] % len(PALETTE) + 1, 0)
    ax.imshow(image, cmap=ListedColormap(("white",) + PALETTE), vmin=0, vmax=len(PALETTE), interpolation="nearest",
              aspect="auto")
    boxes = _block_boxes(lay) if tiles is None else _tile_boxes(lay, mask, *tiles, tile_grid)
    for x0, y0, width, height in boxes:
        ax.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), width, height, **_BOX))
    # Thin lines between the pool's blocks (while there are few enough to tell apart) and between block rows,
    # so the BSR grid reads at a glance.
    if 1 < lay.block_size and lay.num_blocks <= 64:
        ax.set_xticks(np.arange(0, lay.num_slots + 1, lay.block_size) - 0.5, minor=True)
    ax.set_yticks(np.asarray(lay.qo_indptr) - 0.5, minor=True)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.grid(which="minor", color="0.85", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("KV pool slot")
    ax.set_ylabel("query row")
    if title is None:
        title = (f"BSR, Bc = {lay.block_size}: {lay.kv_indices.size} blocks in {lay.num_rows} block rows"
                 if tiles is None else f"{tiles[0]} x {tiles[1]} tiles with a visible pair")
    ax.set_title(title)


def layout(layout: BSRLayout | Cascade, *, variant: Variant | None = None, tiles: tuple[int, int] | None = None,
           tile_grid: str = "row", ax: Axes | Sequence[Axes] | None = None,
           title: str | Sequence[str] | None = None) -> Figure:
    """Draw a layout as its BSR matrix: query rows down, KV pool slots across.

    Each element a query attends — under ``variant``'s position masks and the layout's custom mask — is
    coloured by its block row. Each stored block (block row ``r``'s column block ``kv_indices[j]``: ``Bc`` pool
    slots wide, ``qo_len[r]`` query rows tall) is a grey rectangle. A :class:`~bsrattn.Cascade` is drawn level
    by level, one Axes each.

    Parameters
    ----------
    layout : BSRLayout or Cascade
        What to draw.
    variant : Variant, optional
        Position masks (causal, sliding window) applied to the elements.
    tiles : (int, int), optional
        Draw, instead of the stored blocks, the ``(rows, cols)`` tiles that hold a visible pair.
    tile_grid : {"row", "pool"}
        Where ``tiles`` start. ``"row"``: at each block row's first query and first logical key, as a gather
        kernel tiles a row (a tile over scattered blocks is one rectangle per run of consecutive pool slots).
        ``"pool"``: aligned to the pool, as a kernel that loads fixed blocks straight from the pool must read.
    ax : Axes, or a sequence of Axes (one per level of a Cascade), optional
        Where to draw; by default a new figure.
    title : str, or a sequence of str (one per level), optional
        By default the block size and block counts (for a Cascade: ``level i``).

    Returns
    -------
    matplotlib.figure.Figure
        The figure drawn into.

    Raises
    ------
    TypeError
        ``layout`` neither a BSRLayout nor a Cascade.
    ValueError
        A ``tile_grid`` other than ``"row"``/``"pool"``, a number of Axes or titles that is not the number of
        levels, or a row that lists a slot twice.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn import draw
    >>> lay = ba.layouts.paged([1, 2], [[2, 0], [1]], kv_lens=[7, 3], page_size=4, num_pages=3)
    >>> fig = draw.layout(lay)
    >>> [(round(p.get_x() + 0.5), round(p.get_y() + 0.5), p.get_width(), p.get_height()) for p in fig.axes[0].patches]
    [(8, 0, 4, 1), (0, 0, 4, 1), (4, 1, 4, 2)]
    """
    lay = layout
    if isinstance(lay, Cascade):
        levels = lay.levels
        titles = [f"level {i}" for i in range(len(levels))] if title is None else list(title)
        if len(titles) != len(levels):
            raise ValueError(f"title: {len(levels)} titles needed for the Cascade's levels, {len(titles)} given")
        fig, axes = _axes(ax, len(levels), figsize=(5 * len(levels), 2.8))
        for i, (level, level_ax) in enumerate(zip(levels, axes)):
            _draw_bsr(level_ax, level, None if variant is None else lay.level_variant(i, variant), tiles, tile_grid,
                      titles[i])
        return fig
    if not isinstance(lay, BSRLayout):
        raise TypeError(f"layout must be a BSRLayout or a Cascade, got {type(lay).__name__}")
    fig, (axis,) = _axes(ax, figsize=(8, 2.8))
    _draw_bsr(axis, lay, variant, tiles, tile_grid, title)
    return fig


def plan(work_plan: WorkPlan, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """A Gantt chart of a :class:`~bsrattn.scheduler.WorkPlan`: one lane per CTA, its items in run order.

    Time is the plan's cost model: item ``w`` is a bar ``item_cost[w]`` long (query rows + KV slots), starting
    where the CTA's previous item ends, coloured by its block row. Split items — those that write a partial
    state — are hatched. Each merge is a black diamond at the end of the last of its items, when every partial
    state it folds is ready. The dashed line is the makespan, when the busiest CTA finishes.

    Parameters
    ----------
    work_plan : WorkPlan
        The plan, from :func:`bsrattn.scheduler.plan` or ``BatchAttention.work_plans``.
    ax : Axes, optional
        Where to draw; by default a new figure.
    title : str, optional
        Put before the makespan in the title.

    Returns
    -------
    matplotlib.figure.Figure
        The figure drawn into.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn import draw
    >>> p = ba.scheduler.plan([1, 1], [100, 10], num_ctas=4)
    >>> fig = draw.plan(p)
    >>> [(round(bar.get_y() + 0.4), round(bar.get_x()), round(bar.get_width())) for bar in fig.axes[0].patches]
    [(0, 0, 29), (1, 0, 29), (2, 0, 29), (3, 0, 17), (3, 17, 11)]
    >>> fig.axes[0].get_title()
    'makespan 29'
    """
    fig, (axis,) = _axes(ax, figsize=(9, max(2.0, 0.3 * work_plan.num_ctas + 1.2)))
    cta = np.repeat(np.arange(work_plan.num_ctas), np.diff(work_plan.cta_indptr))       # [W]
    cost = work_plan.item_cost.astype(np.float64)
    start = np.zeros_like(cost)
    for c in range(work_plan.num_ctas):
        lo, hi = work_plan.cta_indptr[c], work_plan.cta_indptr[c + 1]
        start[lo:hi] = np.concatenate([[0.0], np.cumsum(cost[lo:hi])[:-1]])
    colors = [PALETTE[int(r) % len(PALETTE)] for r in work_plan.item_row]
    bars = axis.barh(cta.tolist(), cost.tolist(), left=start.tolist(), height=0.8, color=colors, edgecolor="white",
                     linewidth=0.6)
    split = work_plan.item_partial >= 0
    for bar, is_split in zip(bars, split):
        if is_split:
            bar.set_hatch("///")
    # Merge m folds the partial states whose first rows are merge_partials[merge_indptr[m]:merge_indptr[m+1]].
    item_of_partial = {int(p): w for w, p in enumerate(work_plan.item_partial) if p >= 0}
    merge_x, merge_y = [], []
    for m in range(work_plan.num_merges):
        items = [item_of_partial[int(p)] for p in
                 work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]]
        last = max(items, key=lambda w: start[w] + cost[w])
        merge_x.append(start[last] + cost[last])
        merge_y.append(cta[last])
    handles = []
    if merge_x:
        handles += axis.plot(merge_x, merge_y, "D", color="black", markersize=5, label="merge")
    span = float(work_plan.cta_loads().max()) if work_plan.num_ctas else 0.0
    axis.axvline(span, color="black", linestyle="--", linewidth=1)
    axis.set_ylim(work_plan.num_ctas - 0.5, -0.5)
    if work_plan.num_ctas <= 16:
        axis.set_yticks(range(work_plan.num_ctas))
    axis.set_xlabel("cost (query rows + KV slots)")
    axis.set_ylabel("CTA")
    axis.set_title(f"{title}  makespan {span:.0f}" if title else f"makespan {span:.0f}")
    if split.any():
        handles.insert(0, Patch(facecolor="white", edgecolor="0.3", hatch="///", label="split item (partial state)"))
        axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def read_amplification(layout: BSRLayout, block_sizes: Sequence[int], *, ax: Axes | None = None,
                       label: str | None = None) -> Figure:
    """Slots read / slots needed by a kernel that loads aligned blocks of each of ``block_sizes`` pool slots.

    The ratios are :meth:`BSRLayout.read_amplification`'s, drawn against the block size on log-2 axes, with the
    layout's own block size (where a gather reads exactly what is needed) as a dotted line. Call it again on
    the same ``ax`` to compare layouts.

    Parameters
    ----------
    layout : BSRLayout
        The layout whose needed slots are read.
    block_sizes : sequence of int
        Kernel block sizes, in pool slots.
    ax : Axes, optional
        Where to draw; by default a new figure.
    label : str, optional
        The curve's legend entry.

    Returns
    -------
    matplotlib.figure.Figure
        The figure drawn into.

    Raises
    ------
    TypeError
        ``layout`` not a BSRLayout.
    ValueError
        A block size below 1.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> from bsrattn import draw
    >>> pages = np.arange(64) * 64          # 64 scattered pages of 16 slots
    >>> lay = ba.layouts.paged([1], [pages], kv_lens=[1024], page_size=16, num_pages=4096)
    >>> fig = draw.read_amplification(lay, [16, 32, 64, 128])
    >>> fig.axes[0].get_lines()[0].get_ydata().tolist()
    [1.0, 2.0, 4.0, 8.0]
    """
    if not isinstance(layout, BSRLayout):
        raise TypeError(f"layout must be a BSRLayout, got {type(layout).__name__}")
    sizes = [int(b) for b in block_sizes]
    ratios = [layout.read_amplification(b).ratio for b in sizes]
    fig, (axis,) = _axes(ax, figsize=(6, 3.2))
    axis.plot(sizes, ratios, marker="o", label=label)
    if not any(line.get_gid() == "storage block" and line.get_xdata()[0] == layout.block_size
               for line in axis.get_lines()):
        axis.axvline(layout.block_size, color="0.6", linestyle=":", gid="storage block")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log", base=2)
    axis.set_xlabel("kernel block size (slots)")
    axis.set_ylabel("slots read / slots needed")
    if label is not None:
        axis.legend(handles=[line for line in axis.get_lines() if not line.get_label().startswith("_")])
    return fig
