"""A draft tree as a custom mask: each node sees the committed tokens, its ancestors and itself.

Speculative decoding checks a whole tree of drafted tokens in one forward pass. Node i of the tree is query row i
and also one of the request's last len(parents) KV slots, in node order. A node must not see its siblings or its
cousins, so the mask is data (the layout's custom_mask), not a function of positions:

    parents [-1, 0, 0, 1], kv_len 6: 2 committed tokens, then the 4 nodes

                                      committed    nodes
                                       c0 c1  |  n0 n1 n2 n3
          n0              q n0          x  x  |  x  .  .  .
         /  \\             q n1          x  x  |  x  x  .  .
       n1    n2           q n2          x  x  |  x  .  x  .
       |                  q n3          x  x  |  x  x  .  x
       n3

parents[i] is node i's parent: -1 for a root (a tree may have several), else a node before i. Match
`ba.layouts.tree(...).row_mask(r)`.

Check it: python -m bsrattn.exercises check 21
"""

import numpy as np


def tree_mask(parents, kv_len):  # parents [n]
    """``[n, kv_len]`` bool: row ``i`` is what node ``i`` sees."""
    raise NotImplementedError("exercise 21: every committed slot, then walk up from node i to its root")
