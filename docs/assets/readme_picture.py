"""Draw ``docs/assets/bsr_layouts.png``, the picture at the top of the README, with ``bsrattn.draw``.

    python docs/assets/readme_picture.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

import bsrattn as ba  # noqa: E402
from bsrattn import draw  # noqa: E402

PICTURE = Path(__file__).with_name("bsr_layouts.png")


def figure():
    """Three layouts, one matrix each: a paged decode (the README's), a ragged causal batch, a draft tree."""
    paged = ba.layouts.paged(qo_lens=[1, 1, 1], page_tables=[[0, 3, 5], [1, 2], [4, 6, 7]], kv_lens=[40, 20, 48],
                             page_size=16, num_pages=8)
    ragged = ba.layouts.ragged(qo_lens=[6, 3, 1], kv_lens=[6, 9, 5])
    tree = ba.layouts.tree([[-1, 0, 0, 1, 1, 2]], page_tables=[[2, 0, 1]], kv_lens=[12], page_size=4, num_pages=3)
    fig, axes = plt.subplots(1, 3, figsize=(13, 2.9), layout="constrained", gridspec_kw={"width_ratios": [2.2, 1, 1]})
    draw.layout(paged, ax=axes[0], title="paged KV cache: Bc = page size (16)")
    draw.layout(ragged, variant=ba.Variant(causal=True), ax=axes[1], title="ragged causal batch: Bc = 1")
    draw.layout(tree, ax=axes[2], title="draft tree: a custom mask, Bc = 4")
    return fig


def main(path=PICTURE):
    figure().savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    print(main())
