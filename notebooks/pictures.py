"""Pictures the notebooks share: a layout drawn as a BSR matrix, a plan drawn as a Gantt chart.

Plain matplotlib on NumPy arrays; every function draws into an ``ax`` it is given and returns it, so a
notebook lays out its own figure.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

# Tableau's ten categorical colours: request r is colour r % 10 in every picture.
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac"]


def draw_mask(ax, mask, block_rows=None, block_cols=None, title="", row_owner=None):
    """Draw ``mask [rows, cols]`` (bool) element by element, with the ``(Br, Bc)`` tiles it occupies shaded.

    ``row_owner [rows]`` colours each query row by the request it belongs to; occupied tiles get a light
    grey, so the picture shows at once what a tile-granular kernel would load and what it needs.
    """
    mask = np.asarray(mask, dtype=bool)
    rows, cols = mask.shape
    owner = np.zeros(rows, dtype=int) if row_owner is None else np.asarray(row_owner)
    image = np.where(mask, owner[:, None] % len(PALETTE) + 1, 0)
    ax.imshow(image, cmap=ListedColormap(["white"] + PALETTE), vmin=0, vmax=len(PALETTE),
              interpolation="nearest", aspect="auto")
    # A (1, 1) tile is the element itself: shading it would add nothing.
    if block_rows and block_cols and block_rows * block_cols > 1:
        nbr, nbc = -(-rows // block_rows), -(-cols // block_cols)
        padded = np.zeros((nbr * block_rows, nbc * block_cols), dtype=bool)
        padded[:rows, :cols] = mask
        occupied = padded.reshape(nbr, block_rows, nbc, block_cols).any(axis=(1, 3))
        for i, j in zip(*np.nonzero(occupied)):
            ax.add_patch(Rectangle((j * block_cols - 0.5, i * block_rows - 0.5), block_cols, block_rows,
                                   facecolor="0.5", alpha=0.18, edgecolor="0.3", linewidth=0.8))
        ax.set_xticks(np.arange(0, cols + 1, block_cols) - 0.5, minor=True)
        ax.set_yticks(np.arange(0, rows + 1, block_rows) - 0.5, minor=True)
        ax.grid(which="minor", color="0.85", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
    ax.set_xlabel("KV pool slot")
    ax.set_ylabel("query row")
    ax.set_title(title)
    return ax


def row_owner(layout):
    """``[nnz_qo]``: the block row (request) each query row belongs to."""
    return np.repeat(np.arange(layout.num_rows), layout.qo_lens)


def draw_layout(ax, layout, block_rows=1, block_cols=None, variant=None, title=""):
    """Draw ``layout``'s dense mask (under ``variant``'s position masks) on ``(Br, Bc)`` tiles."""
    block_cols = layout.block_size if block_cols is None else block_cols
    return draw_mask(ax, layout.to_dense_mask(variant), block_rows, block_cols, title, row_owner(layout))


def draw_row_tiles(ax, layout, tile_q, tile_kv, variant=None, title=""):
    """Draw ``layout``'s mask with the tiles a kernel computes: ``tile_q`` queries x ``tile_kv`` logical keys.

    Unlike :func:`draw_layout`, tiles start at each request's own first query and first key, as a kernel's
    do: a tile never straddles two requests. Tiles with no visible pair are skipped, as a kernel skips them.
    """
    mask = layout.to_dense_mask(variant)
    draw_mask(ax, mask, title=title, row_owner=row_owner(layout))
    for r in range(layout.num_rows):
        slots = layout.kv_slots(r)
        qs, qe = int(layout.qo_indptr[r]), int(layout.qo_indptr[r + 1])
        visible = mask[qs:qe][:, slots]
        for q0 in range(0, qe - qs, tile_q):
            for k0 in range(0, slots.size, tile_kv):
                if not visible[q0:q0 + tile_q, k0:k0 + tile_kv].any():
                    continue
                tile_slots = slots[k0:k0 + tile_kv]
                # One rectangle per run of consecutive pool slots (a paged tile may span several pages).
                runs = np.split(tile_slots, np.flatnonzero(np.diff(tile_slots) != 1) + 1)
                height = min(tile_q, qe - qs - q0)
                for run in runs:
                    ax.add_patch(Rectangle((run[0] - 0.5, qs + q0 - 0.5), run.size, height, facecolor="0.5",
                                           alpha=0.18, edgecolor="0.3", linewidth=0.8))
    return ax


def draw_gantt(ax, work_plan, title=""):
    """A Gantt chart of ``work_plan``: one bar per CTA, its items in run order, coloured by request.

    Bar lengths are the plan's cost model (``item_cost``: query rows + KV slots); the dashed line is the
    makespan, the time at which the busiest CTA finishes.
    """
    loads = work_plan.cta_loads()
    for c in range(work_plan.num_ctas):
        start = 0
        for w in range(work_plan.cta_indptr[c], work_plan.cta_indptr[c + 1]):
            cost = int(work_plan.item_cost[w])
            color = PALETTE[int(work_plan.item_row[w]) % len(PALETTE)]
            ax.barh(c, cost, left=start, color=color, edgecolor="white", linewidth=0.6, height=0.8)
            start += cost
    span = loads.max() if loads.size else 0
    ax.axvline(span, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(work_plan.num_ctas - 0.5, -0.5)
    ax.set_xlabel("cost (query rows + KV slots)")
    ax.set_ylabel("CTA")
    ax.set_title(f"{title}  makespan {span:.0f}" if title else f"makespan {span:.0f}")
    return ax
