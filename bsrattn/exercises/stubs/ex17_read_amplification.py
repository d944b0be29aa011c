"""Read amplification: the KV slots a kernel of fixed block size reads to serve a layout, against those needed.

A kernel that loads aligned blocks of B pool slots must read every block that holds a slot a row needs. A row of
scattered 16-slot pages read by a kernel of B = 128 drags in 128 slots for each page:

    pool slots   0 ........ 127 | 128 ...... 255 | 256 ...... 383
    needed       ██               ██               ██                 3 pages x 16 = 48 slots needed
    read         ███████████████  ███████████████  ███████████████    3 blocks x 128 = 384 slots read: 8x

Count per row: a slot two rows need counts twice, and each row reads its blocks. Return (needed, read), as
`ba.BSRLayout.read_amplification(kernel_block_size)` counts them. The paper's case is a budget of 64 pages of 16,
scattered over a 32k context: 1x at B = 16, 8x at B = 128. FlashInfer gathers at any Bc, so it reads what it needs.

Check it: python -m bsrattn.exercises check 17
"""

import numpy as np


def read_amplification(layout, kernel_block_size):  # layout: a ba.BSRLayout
    """``(needed, read)``: slots the rows need, and slots in the aligned blocks holding them, both ints."""
    raise NotImplementedError("exercise 17: per row, its pool slots, and the distinct blocks of B slots they fall in")
