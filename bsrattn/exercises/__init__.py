"""The course's exercises: from the LSE of a row to one tile of a GPU kernel, each graded by hidden tests.

In the spirit of minitorch, GPU Puzzles and Triton Puzzles: each exercise is one file, ``exNN_name.py``, whose
docstring is the statement (with a small picture where one helps) and whose functions are stubs that raise
``NotImplementedError``. A learner fills them in; a grader (:mod:`bsrattn.exercises.graders`) runs them on named
cases — a small readable one, the edge cases, random inputs — against the library's own functions or a float64
oracle, and reports the first case that fails with a hint. The solutions ship beside the stubs and CI grades them.

The stubs ship inside the package, which may be a checkout (an editable install) or a read-only site-packages (a
pip install), so a learner works on a copy, in a folder of their own::

    python -m bsrattn.exercises list               the exercises: number, name, one-line statement
    python -m bsrattn.exercises start [DIR]        copy the stubs into DIR (default ./bsrattn-exercises);
                                                   files already there are kept, never overwritten
    python -m bsrattn.exercises show N             exercise N's statement, and where its file is
    python -m bsrattn.exercises check [N ...]      grade ./bsrattn-exercises when it exists, else the pristine
                                                   stubs shipped in the package (which fail every exercise)
    python -m bsrattn.exercises check --dir DIR    grade the copies in DIR
    python -m bsrattn.exercises check --solutions  grade the shipped solutions

``check`` prints a line per exercise — its number, name and ``pass``, ``fail`` or ``skip`` — and under a failure
its first failing case, what was wrong, and the hint; it exits with 1 when any exercise fails, 0 otherwise (2 for a
usage error). Exercises 19 and 20 launch GPU kernels: on a machine without an NVIDIA GPU, ``check`` selects Numba's
CUDA simulator and Triton's interpreter (``NUMBA_ENABLE_CUDASIM=1``, ``TRITON_INTERPRET=1``) before anything imports
them, and without numba (``pip install 'bsrattn[numba]'``) or triton and torch (``'bsrattn[torch]'``) it skips them,
saying so. Each notebook ends with the exercises that belong to it.

Examples
--------
>>> from bsrattn.exercises import EXERCISES, SOLUTIONS, STUBS, grade
>>> len(EXERCISES), EXERCISES[1].name
(25, 'merge')
>>> grade(EXERCISES[1], SOLUTIONS).status, grade(EXERCISES[1], STUBS).status
('pass', 'fail')
"""

from bsrattn.exercises.course import (DEFAULT_DIR, EXERCISES, SOLUTIONS, STUBS, Exercise, Result, find, grade,
                                      use_simulators_without_gpu)

__all__ = ["EXERCISES", "Exercise", "Result", "grade", "find", "use_simulators_without_gpu", "STUBS", "SOLUTIONS",
           "DEFAULT_DIR"]
