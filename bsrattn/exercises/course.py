"""The course: the table of exercises, where a learner's files are, and grading one exercise.

Each :class:`Exercise` names its file (``exNN_name.py``: the stub in ``stubs/``, the solution in ``solutions/``,
a learner's copy in their folder), the notebook it belongs to, its hint and its grader
(:mod:`bsrattn.exercises.graders`). The one-line statement is the first line of the stub's docstring, read without
importing it, so the stub's text is the only statement there is.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from bsrattn.exercises import graders, layout_graders
from bsrattn.exercises.checks import Failure

PACKAGE = Path(__file__).resolve().parent
STUBS = PACKAGE / "stubs"
"""The pristine stubs, shipped with the package (a learner's copy starts as these)."""
SOLUTIONS = PACKAGE / "solutions"
"""The shipped solutions, which CI grades."""
DEFAULT_DIR = Path("bsrattn-exercises")
"""A learner's folder when none is named: ``./bsrattn-exercises``, relative to where the command runs."""

NUMBA = (("numba.cuda", "numba"),)
TRITON = (("triton", "torch"), ("torch", "torch"))


@dataclass(frozen=True)
class Exercise:
    """One exercise: its number, name and file, the notebook it follows, how it is graded and what it needs.

    Parameters
    ----------
    number : int
        Its place in the course, from 1.
    name : str
        A short name (``"lse"``, ``"page-table"``).
    notebook : str
        The notebook whose ideas it exercises (``"07_attention_state_and_merge"``).
    grader : callable
        ``grader(module)`` raises :class:`~bsrattn.exercises.checks.Failure` at the learner's first wrong case.
    hint : str
        Shown under the first failing case.
    requires : tuple of (str, str)
        ``(module, extra)`` pairs: the modules it imports beyond the light install, and the extra that brings each.

    Examples
    --------
    >>> from bsrattn.exercises import EXERCISES
    >>> EXERCISES[0].filename, EXERCISES[0].notebook
    ('ex01_lse.py', '07_attention_state_and_merge')
    """

    number: int
    name: str
    notebook: str
    grader: Callable[[ModuleType], None]
    hint: str
    requires: tuple = ()

    @property
    def filename(self) -> str:
        """``exNN_name.py``, the file of its stub, its solution and a learner's copy."""
        return f"ex{self.number:02d}_{self.name.replace('-', '_')}.py"

    @property
    def statement(self) -> str:
        """The full statement: the stub's module docstring."""
        return ast.get_docstring(ast.parse((STUBS / self.filename).read_text(encoding="utf-8"))) or ""

    @property
    def summary(self) -> str:
        """The one-line statement: the first line of the stub's docstring."""
        return self.statement.splitlines()[0]


@dataclass(frozen=True)
class Result:
    """How one exercise fared: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"``.

    Parameters
    ----------
    exercise : Exercise
        The exercise graded.
    status : str
        ``"pass"``, ``"fail"`` or ``"skip"`` (what it needs is not installed).
    case : str
        The first failing case, or why it was skipped; empty on a pass.
    detail : str
        What went wrong in that case; empty otherwise.

    Examples
    --------
    >>> from bsrattn.exercises import EXERCISES, SOLUTIONS, grade
    >>> grade(EXERCISES[0], SOLUTIONS).status
    'pass'
    """

    exercise: Exercise
    status: str
    case: str = ""
    detail: str = ""


EXERCISES = (
    Exercise(1, "lse", "07_attention_state_and_merge", graders.lse, hint=(
        "Shift by the row's max m before exp: lse = m + log(sum(exp(s - m))). np.log is the natural log (np.log2 "
        "would give base 2, FlashInfer's internal unit). An empty row, or one of only -inf, has lse = -inf: "
        "return it before subtracting m = -inf (-inf - -inf is NaN).")),
    Exercise(2, "merge", "07_attention_state_and_merge", graders.merge, hint=(
        "Subtract m = max(lse_a, lse_b) before exp, or exp(800) overflows to inf. An empty side (lse = -inf) "
        "must add exactly nothing: its o may be NaN and 0 * NaN is NaN, so leave its term out (np.where, or an "
        "if). When both sides are empty, m is -inf: return (zeros, -inf) directly.")),
    Exercise(3, "page-table", "02_paged_kv_cache", layout_graders.page_table, hint=(
        "A request of kv_len tokens uses ceil(kv_len / page_size) pages, (kv_len + page_size - 1) // page_size; "
        "kv_indptr is 0 then the running sum of those counts ([B+1] entries). The last page holds "
        "kv_len - (pages - 1) * page_size slots, page_size (not 0) when it is full, and 0 for a request with no "
        "pages. Take only the pages needed from each table.")),
    Exercise(4, "ragged", "03_ragged_variable_length", layout_graders.ragged, hint=(
        "Both indptrs are 0 followed by the running sums of the lengths ([B+1] entries). With Bc = 1 the indices "
        "are every slot of the buffer in order, and each row's last block holds 1 slot, or none for a row "
        "with no keys: min(kv_len, 1).")),
    Exercise(5, "pool-slot", "01_bsr_in_one_picture", layout_graders.pool_slot, hint=(
        "kv_indices holds block ids, not slots: the block's first slot is its id times Bc. Index kv_indices at "
        "kv_indptr[r] + i // Bc (the row's own blocks start at kv_indptr[r]), multiply by Bc, add i % Bc. "
        "Written with NumPy operators, the same expression serves an int i and an array of them.")),
    Exercise(6, "causal-mask", "03_ragged_variable_length", layout_graders.causal_mask, hint=(
        "Bottom-right, not top-left: query i sits at position kv_len - qo_len + i, and sees key j when "
        "j <= that position. Build both positions as broadcastable arrays, [qo_len, 1] and [1, kv_len].")),
    Exercise(7, "sliding-window", "03_ragged_variable_length", layout_graders.sliding_window, hint=(
        "The window is inclusive: q_pos - k_pos <= window_left, with q_pos = kv_len - qo_len + i. window_left = -1 "
        "switches it off (every key passes it). Causality is a second, separate condition, k_pos <= q_pos, "
        "applied only when causal is True.")),
    Exercise(8, "cascade", "04_shared_prefix_cascade", layout_graders.cascade, hint=(
        "Level 0 is a paged layout of ONE row: qo_indptr [0, sum(qo_lens)], over the prefix's "
        "ceil(prefix_len / page_size) pages. Level 1 is an ordinary paged batch of the suffixes, one row per "
        "request, qo_indptr the running sum of qo_lens. A level with no tokens has kv_last_len 0.")),
    Exercise(9, "quest", "06_kv_pruning_quest", layout_graders.quest, hint=(
        "page_bounds: take each page's min and max key per dimension over its valid slots only (the first kv_len "
        "slots of the request; mask the rest with +inf for the min and -inf for the max), then "
        "sum_d max(q_d * min_d, q_d * max_d) — both products, since q_d may be negative. select_pages: the last page "
        "always, then the budget - 1 largest bounds of the others (np.argsort(-bounds, kind='stable') keeps ties in "
        "page order), sorted.")),
    Exercise(10, "online-softmax", "07_attention_state_and_merge", graders.online_softmax, hint=(
        "Rescale what you had: alpha = exp(m - m_new) multiplies both l and acc before the tile's terms are added. "
        "While no visible key has been seen m_new is -inf: use 0 in its place in the exponents (exp(-inf - 0) = 0, "
        "where -inf - -inf is NaN). finish returns (zeros, -inf) when l is 0. Use s.max(initial=-np.inf) for a "
        "tile that may be empty.")),
    Exercise(11, "gather", "01_bsr_in_one_picture", layout_graders.gather, hint=(
        "A row of n blocks holds (n - 1) * Bc + kv_last_len[r] slots (none when n is 0). Slot i of it is pool slot "
        "kv_indices[kv_indptr[r] + i // Bc] * Bc + i % Bc, and x.reshape(-1, Hkv, D) indexes the pool by slot.")),
    Exercise(12, "block-row", "09_backends", graders.block_row, hint=(
        "Keep m, l [qo_len, H] and acc [qo_len, H, D] and give every (query, head) exercise 10's update, tile after "
        "tile. A key's position is its place in the row (start + j), a query's kv_len - qo_len + i, and under "
        "causal a key past the query scores -inf. np.einsum('qhd,khd->qhk', q, k_tile) gives every score of a "
        "tile. Guard m = -inf in the exponents; a query that saw no key ends with o = 0 and lse = -inf.")),
    Exercise(13, "split-merge", "07_attention_state_and_merge", graders.split_merge, hint=(
        "Chunks start at 0, chunk, 2 * chunk, ... below kv_len, the last one cut at kv_len (no empty chunk after "
        "it); only a row with no keys asks for state_of(0, 0). Fold left to right: acc = state 0, then "
        "acc = ba.merge_state(acc, state c) for c = 1, 2, ... — not the other way round, and not pairwise.")),
    Exercise(14, "plan-merges", "08_scheduler", graders.plan_merges, hint=(
        "For merge m, its partials' first rows are plan.merge_partials[plan.merge_indptr[m]:plan.merge_indptr[m+1]] "
        "and it covers n = merge_qo_end[m] - merge_qo_start[m] query rows: partial p's state is part_o[p:p + n], "
        "part_lse[p:p + n]. Start from the first, fold the rest in the listed order with ba.merge_state, write "
        "into out[qs:qe] and lse[qs:qe], and touch no other row.")),
    Exercise(15, "lpt-plan", "08_scheduler", graders.lpt_plan, hint=(
        "chunk_size: sum ceil(qo / T_q) * kv over the rows, ceil-divide by num_ctas, at least 1. work_items: query "
        "rows are absolute (row r's start at the sum of the earlier qo_lens), each tile's chunks start at 0, chunk, "
        "... and a row with no keys has one chunk 0:0. assign: sort the items by cost, longest first, keeping item "
        "order among equal costs (sorted is stable), and pop/push (load, cta) pairs on a heapq min-heap.")),
    Exercise(16, "makespan", "08_scheduler", graders.makespan, hint=(
        "CTA c's load is item_cost[cta_indptr[c]:cta_indptr[c+1]].sum(); the makespan is the largest load, 0 for a "
        "CTA without items. The bound is the larger of the average load, sum(costs) / num_ctas (a float), and the "
        "longest single item; 0.0 when there are no items.")),
    Exercise(17, "read-amplification", "10_performance", graders.read_amplification, hint=(
        "Per row: needed += its number of slots; read += (the number of distinct values of slots // B) * B. Count "
        "row by row — a block two rows read is read by each — and return plain ints (needed, read).")),
    Exercise(18, "chunk-grid", "12_partition_invariance", graders.chunk_grid, hint=(
        "The cuts are kv_start, then every multiple of split_size strictly between kv_start and kv_end — the first "
        "is (kv_start // split_size + 1) * split_size — then kv_end. Absolute multiples, not kv_start plus "
        "multiples. An empty range gives the one chunk (kv_start, kv_start).")),
    Exercise(19, "numba-tile", "09_backends", graders.numba_tile, requires=NUMBA, hint=(
        "Each thread computes its row's m_new from m[i] and the whole row s[i, :], shifts by 0 instead when m_new is "
        "-inf, and rescales its own acc[i, d] by alpha = exp(m[i] - m_new) before adding sum_j p_j v[j, d]. Only "
        "thread 0 updates l[i] and m[i], and only after cuda.syncthreads(): written earlier, m[i] would change "
        "under threads that have not read it yet.")),
    Exercise(20, "triton-tile", "09_backends", graders.triton_tile, requires=TRITON, hint=(
        "Load the tile's slots with mask j < num_keys (other=0, a valid row), then the k and v rows at "
        "slot[:, None] * HEAD_DIM + d[None, :] under the same mask. Set the scores of keys past num_keys to -inf "
        "before the max, so that they weigh exp(-inf) = 0; rescale both l_i and acc by alpha = exp(m_i - m_new); "
        "add tl.dot(p, v); give both dots input_precision='ieee'; and carry m_i = m_new into the next tile.")),
    Exercise(21, "tree-mask", "05_tree_decoding", layout_graders.tree_mask, hint=(
        "With n = len(parents) nodes, the first kv_len - n slots are committed: every node sees them. Node i is "
        "slot kv_len - n + i; walk node = i, parents[i], parents[parents[i]], ... until -1, setting each one's "
        "slot in row i.")),
    Exercise(22, "score-transform", "09_backends", graders.score_transform, hint=(
        "In this order: s = sm_scale * qk; if soft_cap > 0, s = soft_cap * np.tanh(s / soft_cap); if alibi_slope "
        "is not None, s = s + alibi_slope * (k_pos[None, :] - q_pos[:, None]). ALiBi after the cap.")),
    Exercise(23, "gqa", "11_inside_a_model", graders.gqa, hint=(
        "G = num_qo_heads // num_kv_heads and query head h reads KV head h // G. Tile row i is query i // G in "
        "head kv_head * G + i % G. The expansion repeats each KV head G times side by side, np.repeat(k, G, axis=1): "
        "np.tile would lay out KV heads 0, 1, 0, 1, ... .")),
    Exercise(24, "dense-mask", "01_bsr_in_one_picture", layout_graders.dense_mask, hint=(
        "Start from all False, [nnz_qo, num_slots]. For each block row r: its query rows qo_indptr[r]:qo_indptr[r+1] "
        "by its pool slots kv_slots(r) get a [qo_len, kv_len] block: True, and-ed with row_mask(r) when it is not "
        "None, and with the causal mask k_pos <= kv_len - qo_len + i when causal (positions are logical: i along "
        "the row).")),
    Exercise(25, "mla-as-attention", "13_latent_attention", graders.mla_as_attention, hint=(
        "Concatenate along the last axis (np.concatenate(..., axis=-1)), the latent part first in both q and k, and "
        "give k a KV-head axis of 1 just before the last ([..., None, :]). The value is ckv alone, not ckv ⊕ kpe: "
        "the key's first Dc columns, a view of it. Index from the end, and one expression serves ckv "
        "[pages, page_size, Dc] and [slots, Dc].")),
)
"""The course, in order."""


def find(number: int) -> Exercise:
    """The exercise numbered ``number``.

    Parameters
    ----------
    number : int
        From 1 to ``len(EXERCISES)``.

    Returns
    -------
    Exercise

    Raises
    ------
    KeyError
        No exercise has that number.

    Examples
    --------
    >>> find(2).name
    'merge'
    """
    for exercise in EXERCISES:
        if exercise.number == number:
            return exercise
    raise KeyError(f"there is no exercise {number}: the course has 1..{len(EXERCISES)}")


@functools.cache
def _has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def use_simulators_without_gpu() -> None:
    """Select Numba's CUDA simulator and Triton's interpreter when this machine has no NVIDIA GPU.

    Both packages read their variable (``NUMBA_ENABLE_CUDASIM``, ``TRITON_INTERPRET``) once, when first imported,
    so this must run before anything imports them — and bsrattn imports numba for the scheduler's first plan. A
    variable already set is left as it is.

    Returns
    -------
    None

    Examples
    --------
    >>> use_simulators_without_gpu()
    """
    if not _has_nvidia_gpu():
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
        os.environ.setdefault("TRITON_INTERPRET", "1")


def missing(exercise: Exercise) -> str:
    """Why ``exercise`` cannot be graded here (what to install), or ``""`` when it can.

    Parameters
    ----------
    exercise : Exercise
        The exercise.

    Returns
    -------
    str

    Examples
    --------
    >>> missing(find(1))
    ''
    """
    for module, extra in exercise.requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is not installed
            found = False
        if not found:
            return f"needs {module.split('.')[0]}, not installed here: pip install 'bsrattn[{extra}]'"
    return ""


_loaded = itertools.count()


def load(path: Path) -> ModuleType:
    """Import the file ``path`` as a fresh module (Triton and Numba read a kernel's source from its file).

    Parameters
    ----------
    path : Path
        A learner's exercise file, a stub or a solution.

    Returns
    -------
    ModuleType
    """
    name = f"bsrattn_exercise_{next(_loaded)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a kernel's decorator may look its module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def grade(exercise: Exercise, folder: Path) -> Result:
    """Grade ``folder``'s copy of ``exercise`` (its file ``folder / exercise.filename``).

    Parameters
    ----------
    exercise : Exercise
        The exercise.
    folder : Path
        A learner's folder, :data:`STUBS` or :data:`SOLUTIONS`.

    Returns
    -------
    Result
        ``"skip"`` when what the exercise needs is not installed; ``"fail"`` with the first failing case when the
        file is missing, does not import, or gets a case wrong; ``"pass"`` otherwise.

    Examples
    --------
    >>> from bsrattn.exercises import STUBS
    >>> result = grade(find(1), STUBS)
    >>> result.status, result.detail
    ('fail', 'raised NotImplementedError: exercise 1: return m + log(sum(exp(s - m))), with m = max(s)')
    """
    reason = missing(exercise)
    if reason:
        return Result(exercise, "skip", reason)
    path = Path(folder) / exercise.filename
    if not path.is_file():
        return Result(exercise, "fail", f"{path} is missing",
                      f"python -m bsrattn.exercises start {folder} copies the stubs that are not there yet")
    if exercise.requires:
        use_simulators_without_gpu()
    try:
        module = load(path)
    except Exception as err:
        return Result(exercise, "fail", f"importing {path}", f"raised {type(err).__name__}: {err}")
    try:
        exercise.grader(module)
    except Failure as failure:
        return Result(exercise, "fail", failure.case, failure.detail)
    except Exception as err:  # raised outside any case: the learner returned something the grader cannot use
        return Result(exercise, "fail", "grading", f"raised {type(err).__name__}: {err}")
    return Result(exercise, "pass")
