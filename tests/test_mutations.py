"""CI's mutation check: every deliberate fault of ``tests/mutation_check.py`` must make a test fail.

Marked ``mutation`` (a few minutes on two cores); deselect it locally with ``-m "not mutation"``.
"""

from __future__ import annotations

import io
import time

import pytest

import mutation_check

pytestmark = pytest.mark.mutation


def test_every_mutant_is_killed():
    log = io.StringIO()
    start = time.perf_counter()
    # The suite runs every named test unmutated, and fails where one does: no control run here.
    outcomes = mutation_check.run(jobs=2, out=log, control=False)
    assert mutation_check.report(outcomes, time.perf_counter() - start, out=log), log.getvalue()
