"""Exercise 17, solved: the slots needed, and the aligned blocks a fixed-block kernel reads for them."""

import numpy as np


def read_amplification(layout, kernel_block_size):  # layout: a ba.BSRLayout
    """``(needed, read)``: slots the rows need, and slots in the aligned blocks holding them, both ints."""
    needed = read = 0
    for r in range(layout.num_rows):
        slots = layout.kv_slots(r)
        needed += slots.size
        read += np.unique(slots // kernel_block_size).size * kernel_block_size
    return needed, read
