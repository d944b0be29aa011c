"""``bsrattn.draw`` draws what the layout and the plan say: the figures' content is checked, not their pixels.

Every rectangle of a layout picture is a stored block (or a tile holding a visible pair) at the block's pool
slots and query rows; every bar of a Gantt chart is a work item at its CTA, starting where the CTA's previous
item ends; the read-amplification curve plots the layout's own ratios. matplotlib is imported by
``bsrattn.draw`` only, and its absence is reported with the extra that brings it.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import bsrattn as ba  # noqa: E402
from bsrattn import draw  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGED = dict(qo_lens=[2, 1, 3], page_tables=[[7, 2, 4], [0, 9], [5, 1, 8]], kv_lens=[10, 7, 12], page_size=4,
             num_pages=10)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def boxes(ax):
    """``{(x0, y0, width, height)}`` of the rectangles drawn on ``ax``, in slots and query rows."""
    return sorted((round(p.get_x() + 0.5), round(p.get_y() + 0.5), round(p.get_width()), round(p.get_height()))
                  for p in ax.patches if isinstance(p, Rectangle))


def image(ax):
    """The element picture: ``[nnz_qo, num_slots]`` ints, 0 where nothing is attended, else block row % 10 + 1."""
    (picture,) = ax.get_images()
    return np.asarray(picture.get_array())


def test_importing_bsrattn_does_not_import_matplotlib():
    code = ("import sys, bsrattn as ba; ba.layouts.paged([1], [[0]], kv_lens=[3], page_size=4, num_pages=1); "
            "assert 'matplotlib' not in sys.modules, 'import bsrattn imported matplotlib'; "
            "assert 'bsrattn.draw' not in sys.modules; import bsrattn.draw; assert 'matplotlib' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_without_matplotlib_the_error_names_the_extra(tmp_path):
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", "import bsrattn.draw"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: bsrattn.draw needs matplotlib: pip install 'bsrattn[draw]'" in done.stderr, done.stderr


def test_a_paged_layout_is_one_rectangle_per_page_of_each_request():
    layout = ba.layouts.paged(**PAGED)
    ax = draw.layout(layout).axes[0]
    # Request r's pages are Bc = 4 slots wide, as tall as its query rows: rows 0-1, 2, 3-5.
    expected = [(4 * p, q0, 4, n) for pages, q0, n in zip(PAGED["page_tables"], [0, 2, 3], [2, 1, 3]) for p in pages]
    assert boxes(ax) == sorted(expected)
    assert ax.get_xlabel() == "KV pool slot" and ax.get_ylabel() == "query row"
    assert ax.get_title() == "BSR, Bc = 4: 8 blocks in 3 block rows"


def test_the_elements_are_the_dense_mask_coloured_by_request():
    layout = ba.layouts.paged(**PAGED)
    causal = ba.Variant(causal=True)
    picture = image(draw.layout(layout, variant=causal).axes[0])
    mask = layout.to_dense_mask(causal)
    assert picture.shape == mask.shape
    np.testing.assert_array_equal(picture != 0, mask)
    owner = np.repeat([0, 1, 2], [2, 1, 3])
    np.testing.assert_array_equal(picture[mask], (owner[:, None] + 1).repeat(mask.shape[1], axis=1)[mask])


def test_a_tree_layout_shows_its_custom_mask():
    layout = ba.layouts.tree([[-1, 0, 0, 1]], page_tables=[[1, 0]], kv_lens=[7], page_size=4, num_pages=2)
    ax = draw.layout(layout).axes[0]
    np.testing.assert_array_equal(image(ax) != 0, layout.to_dense_mask())
    assert boxes(ax) == [(0, 0, 4, 4), (4, 0, 4, 4)]


def test_block_sparse_blocks_sit_at_their_column_blocks():
    # Two block rows of R = 2 queries; row 0 holds column blocks 0 and 2, row 1 block 1 (C = 3 slots).
    layout = ba.layouts.block_sparse(indptr=[0, 2, 3], indices=[0, 2, 1], M=4, N=9, R=2, C=3)
    assert boxes(draw.layout(layout).axes[0]) == [(0, 0, 3, 2), (3, 2, 3, 2), (6, 0, 3, 2)]


def test_row_tiles_start_at_each_request_and_skip_tiles_without_a_visible_pair():
    layout = ba.layouts.ragged([7, 3, 1], [7, 10, 6])
    ax = draw.layout(layout, variant=ba.Variant(causal=True), tiles=(4, 4)).axes[0]
    # Request 0 (slots 0-6, rows 0-6): a causal 7 x 7 triangle in 4 x 4 tiles: the tile above the diagonal
    # (rows 0-3, keys 4-6) has no visible pair. Request 1 (slots 7-16, rows 7-9) sees all 10 keys; request 2
    # (slots 17-22, row 10) all 6.
    expected = [(0, 0, 4, 4), (0, 4, 4, 3), (4, 4, 3, 3),
                (7, 7, 4, 3), (11, 7, 4, 3), (15, 7, 2, 3),
                (17, 10, 4, 1), (21, 10, 2, 1)]
    assert boxes(ax) == sorted(expected)


def test_row_tiles_over_scattered_pages_are_one_rectangle_per_run_of_slots():
    layout = ba.layouts.paged([1], [[3, 1, 2]], kv_lens=[12], page_size=4, num_pages=4)
    # One 8-key tile covers pages 3 and 1 (slots 12-15 and 4-7), the next page 2 (slots 8-11).
    assert boxes(draw.layout(layout, tiles=(1, 8)).axes[0]) == [(4, 0, 4, 1), (8, 0, 4, 1), (12, 0, 4, 1)]


def test_pool_tiles_are_the_aligned_blocks_a_kernel_reads():
    layout = ba.layouts.paged([1], [[0, 5]], kv_lens=[8], page_size=4, num_pages=8)
    # Pages 0 and 5 are slots 0-3 and 20-23: aligned 16-slot blocks 0 and 1 are read, the 8-slot blocks 0 and 2.
    assert boxes(draw.layout(layout, tiles=(1, 16), tile_grid="pool").axes[0]) == [(0, 0, 16, 1), (16, 0, 16, 1)]
    assert boxes(draw.layout(layout, tiles=(1, 8), tile_grid="pool").axes[0]) == [(0, 0, 8, 1), (16, 0, 8, 1)]
    with pytest.raises(ValueError, match="tile_grid"):
        draw.layout(layout, tiles=(1, 8), tile_grid="aligned")


def test_a_cascade_is_drawn_level_by_level():
    cascade = ba.layouts.shared_prefix(qo_lens=[1, 1, 1], prefix_pages=[0, 1], prefix_len=16,
                                       suffix_page_tables=[[4], [2, 5], [3]], suffix_lens=[6, 13, 3], page_size=8,
                                       num_pages=6)
    fig = draw.layout(cascade)
    assert [ax.get_title() for ax in fig.axes] == ["level 0", "level 1"]
    # The prefix level is one block row three queries tall over pages 0 and 1.
    assert boxes(fig.axes[0]) == [(0, 0, 8, 3), (8, 0, 8, 3)]
    assert boxes(fig.axes[1]) == [(16, 1, 8, 1), (24, 2, 8, 1), (32, 0, 8, 1), (40, 1, 8, 1)]
    fig, axes = plt.subplots(1, 3)
    assert draw.layout(cascade, ax=axes[:2], title=["prefix", "suffixes"]) is fig
    assert [ax.get_title() for ax in axes[:2]] == ["prefix", "suffixes"] and not axes[2].patches
    with pytest.raises(ValueError, match="2 Axes needed"):
        draw.layout(cascade, ax=axes[0])


def gantt_bars(ax):
    """``[(cta, start, length, hatched)]`` of the Gantt chart's bars, in drawing order."""
    return [(round(b.get_y() + b.get_height() / 2), float(b.get_x()), float(b.get_width()), bool(b.get_hatch()))
            for b in ax.patches]


def test_a_plan_is_one_bar_per_item_in_run_order_on_its_cta():
    work_plan = ba.scheduler.plan(np.ones(6, dtype=int), np.array([1900, 240, 410, 1250, 90, 600]), num_ctas=8)
    ax = draw.plan(work_plan, title="Algorithm 1:").axes[0]
    bars = gantt_bars(ax)
    assert len(bars) == work_plan.num_items
    for c in range(work_plan.num_ctas):
        items = range(work_plan.cta_indptr[c], work_plan.cta_indptr[c + 1])
        lane = [bars[w] for w in items]
        starts = np.concatenate([[0], np.cumsum(work_plan.item_cost[list(items)])[:-1]])
        assert [b[0] for b in lane] == [c] * len(lane)
        assert [b[1] for b in lane] == starts.tolist()
        assert [b[2] for b in lane] == work_plan.item_cost[list(items)].tolist()
    np.testing.assert_array_equal(np.bincount([b[0] for b in bars], weights=[b[2] for b in bars],
                                              minlength=work_plan.num_ctas), work_plan.cta_loads())
    assert [b[3] for b in bars] == (work_plan.item_partial >= 0).tolist()
    makespan = work_plan.cta_loads().max()
    assert ax.get_title() == f"Algorithm 1:  makespan {makespan:.0f}"
    assert ax.get_xlabel() == "cost (query rows + KV slots)" and ax.get_ylabel() == "CTA"
    (merges,) = [line for line in ax.get_lines() if line.get_label() == "merge"]
    (makespan_line,) = [line for line in ax.get_lines() if line.get_label() != "merge"]
    assert makespan_line.get_xdata()[0] == makespan


def test_each_merge_is_marked_when_its_last_partial_state_is_ready():
    work_plan = ba.scheduler.plan([1, 1, 1], [300, 20, 170], num_ctas=4)
    ax = draw.plan(work_plan).axes[0]
    bars = gantt_bars(ax)
    ends = {}
    for w, (cta, start, length, _) in enumerate(bars):
        if work_plan.item_partial[w] >= 0:
            ends[int(work_plan.item_partial[w])] = (start + length, cta)
    expected = []
    for m in range(work_plan.num_merges):
        parts = work_plan.merge_partials[work_plan.merge_indptr[m]:work_plan.merge_indptr[m + 1]]
        finish = [ends[int(p)] for p in parts]
        last = max(end for end, _ in finish)
        expected.append((last, next(cta for end, cta in finish if end == last)))   # a tie: the first in merge order
    assert work_plan.num_merges == 2
    (merges,) = [line for line in ax.get_lines() if line.get_label() == "merge"]
    assert sorted(zip(merges.get_xdata(), merges.get_ydata())) == sorted(expected)


def test_a_plan_without_splits_has_no_merge_marks():
    work_plan = ba.scheduler.round_robin([1, 1], [100, 40], num_ctas=2)
    ax = draw.plan(work_plan).axes[0]
    assert not any(b[3] for b in gantt_bars(ax))
    assert [line.get_label() for line in ax.get_lines() if line.get_label() == "merge"] == []
    assert ax.get_legend() is None


def test_read_amplification_plots_the_layouts_ratios():
    pages = np.random.default_rng(0).choice(2048 // 16, 6, replace=False)
    layout = ba.layouts.paged([1], [pages], kv_lens=[6 * 16], page_size=16, num_pages=2048 // 16)
    blocks = [1, 4, 16, 64, 128, 512]
    fig = draw.read_amplification(layout, blocks, label="6 pages")
    ax = fig.axes[0]
    curve, storage = ax.get_lines()
    assert curve.get_xdata().tolist() == blocks
    assert curve.get_ydata().tolist() == [layout.read_amplification(b).ratio for b in blocks]
    assert curve.get_ydata()[2] == 1.0 and curve.get_ydata()[-1] > 1.0
    assert storage.get_xdata()[0] == 16
    assert ax.get_xlabel() == "kernel block size (slots)" and ax.get_ylabel() == "slots read / slots needed"
    assert ax.get_xscale() == ax.get_yscale() == "log"
    draw.read_amplification(ba.layouts.paged([1], [[0, 9]], kv_lens=[32], page_size=16, num_pages=10), blocks,
                            ax=ax, label="2 pages")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["6 pages", "2 pages"]
    assert len(ax.get_lines()) == 3, "a second curve of the same page size adds no second storage line"
    with pytest.raises(TypeError, match="BSRLayout"):
        draw.read_amplification(ba.layouts.shared_prefix([1], [0], 4, [[1]], [2], 4, 2), blocks)


def test_the_readme_picture_is_the_one_bsrattn_draw_makes(tmp_path):
    spec = importlib.util.spec_from_file_location("readme_picture", ROOT / "docs" / "assets" / "readme_picture.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fig = script.figure()
    assert [ax.get_title() for ax in fig.axes] == ["paged KV cache: Bc = page size (16)", "ragged causal batch: Bc = 1",
                                                   "draft tree: a custom mask, Bc = 4"]
    # The left panel is the README's page tables: pages of 16, one query row per request.
    assert boxes(fig.axes[0]) == sorted((16 * p, r, 16, 1) for r, pages in enumerate([[0, 3, 5], [1, 2], [4, 6, 7]])
                                        for p in pages)
    drawn = script.main(tmp_path / "picture.png")
    committed = script.PICTURE
    assert committed.stat().st_size < 100 * 1024
    assert plt.imread(drawn).shape == plt.imread(committed).shape, "redraw it: python docs/assets/readme_picture.py"
