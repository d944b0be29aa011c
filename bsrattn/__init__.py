"""bsrattn: every KV-cache layout is one block-sparse-row matrix, served by one attention kernel.

Examples
--------
>>> import bsrattn as ba
>>> sorted(ba.backends.REGISTRY)
['numba', 'reference', 'torch']
"""

from bsrattn import backends, indexing, layouts, scheduler
from bsrattn.api import BatchAttention, attention
from bsrattn.state import merge_state, merge_states
from bsrattn.backends import Backend, BackendError, get_backend, set_backend, use_backend
from bsrattn.cascade import Cascade
from bsrattn.layout import BSRLayout, ReadAmplification
from bsrattn.mla import BatchMLAAttention, mla_attention
from bsrattn.variant import Variant

__version__ = "0.1.0"

__all__ = ["BSRLayout", "Cascade", "ReadAmplification", "Variant", "attention", "BatchAttention", "merge_state",
           "merge_states", "layouts", "scheduler", "backends", "indexing", "Backend", "BackendError",
           "get_backend", "set_backend", "use_backend", "mla_attention", "BatchMLAAttention"]
