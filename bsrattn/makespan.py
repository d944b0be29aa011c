"""The makespan study: how much Algorithm 1 shortens the busiest CTA's work against a baseline.

A plan's makespan under the cost model is its most loaded CTA's total cost (:func:`makespan`). :func:`compare`
draws random decode batches from one of :data:`DISTRIBUTIONS` and reports, per trial, a baseline plan's
makespan over a balanced plan's: the seed's scheduler table. The planners are arguments, so the study depends
on no scheduler; :func:`bsrattn.scheduler.simulate` runs it with :func:`~bsrattn.scheduler.round_robin` against
:func:`~bsrattn.scheduler.plan`, and :mod:`bsrattn.scheduler` re-exports this module's names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["makespan", "compare", "SimulationResult", "DISTRIBUTIONS"]


class _Plan(Protocol):
    """What the study reads of a :class:`~bsrattn.scheduler.WorkPlan` (it imports no scheduler)."""

    def cta_loads(self, cost: ArrayLike | None = None) -> np.ndarray: ...


def makespan(work_plan: _Plan, cost: ArrayLike | None = None) -> float:
    """The most loaded CTA's total cost: the plan's finishing time under the cost model.

    ``work_plan`` is a :class:`~bsrattn.scheduler.WorkPlan`; ``cost`` (``[W]``) defaults to its ``item_cost``.

    Parameters
    ----------
    work_plan : WorkPlan
        The plan.
    cost : array_like of float, ``[W]``, optional
        Each item's cost; default ``work_plan.item_cost``.

    Returns
    -------
    float
        The largest CTA load (0.0 for a plan without CTAs).

    Examples
    --------
    >>> import bsrattn as ba
    >>> ba.scheduler.makespan(ba.scheduler.round_robin([1, 1], [100, 10], num_ctas=4))
    101.0
    >>> ba.scheduler.makespan(ba.scheduler.plan([1, 1], [100, 10], num_ctas=4))
    29.0
    """
    loads = work_plan.cta_loads(cost)
    return float(loads.max()) if loads.size else 0.0


def _uniform(lo, hi):
    return lambda rng, n: rng.integers(lo, hi + 1, size=n)


DISTRIBUTIONS = {
    "uniform kv=2048": lambda rng, n: np.full(n, 2048),
    "U(512, 2048)": _uniform(512, 2048),
    "U(4096, 16384)": _uniform(4096, 16384),
    "lognormal": lambda rng, n: np.clip(rng.lognormal(mean=6.5, sigma=0.75, size=n), 16, 131072).astype(np.int64),
}
"""Decode KV-length distributions of the seed's makespan table (the lognormal is ShareGPT-like)."""


@dataclass(frozen=True)
class SimulationResult:
    """Baseline makespan over balanced makespan, per trial; returned by :func:`compare` (and so by
    :func:`bsrattn.scheduler.simulate`, round robin over Algorithm 1).

    Parameters
    ----------
    distribution : str
        The key of :data:`DISTRIBUTIONS` the KV lengths were drawn from.
    batch : int
        Requests per trial.
    ratios : numpy.ndarray, ``[trials]``
        Baseline makespan over balanced makespan, per trial.

    Examples
    --------
    >>> import numpy as np, bsrattn as ba
    >>> r = ba.scheduler.SimulationResult("U(512, 2048)", 32, np.array([5.0, 6.0, 7.0]))
    >>> r.median, r.min, r.max
    (6.0, 5.0, 7.0)
    """

    distribution: str
    batch: int
    ratios: np.ndarray

    @property
    def median(self) -> float:
        """Median ratio over the trials."""
        return float(np.median(self.ratios))

    @property
    def min(self) -> float:
        """Smallest ratio."""
        return float(self.ratios.min())

    @property
    def max(self) -> float:
        """Largest ratio."""
        return float(self.ratios.max())


def compare(baseline: Callable[[np.ndarray, np.ndarray], _Plan],
            balanced: Callable[[np.ndarray, np.ndarray], _Plan], distribution: str, batch: int, *, trials: int,
            seed: int) -> SimulationResult:
    """``makespan(baseline(qo, kv)) / makespan(balanced(qo, kv))`` on ``trials`` random decode batches.

    Each batch is ``batch`` requests of one query row with KV lengths drawn from ``DISTRIBUTIONS[distribution]``
    (one NumPy generator seeded with ``seed`` for all trials); ``baseline`` and ``balanced`` map ``qo_lens``,
    ``kv_lens`` (``[batch]``) to a :class:`~bsrattn.scheduler.WorkPlan`.

    Parameters
    ----------
    baseline, balanced : callable
        Planners ``(qo_lens, kv_lens) -> WorkPlan``; the ratio is the baseline's makespan over the balanced one's.
    distribution : str
        A key of :data:`DISTRIBUTIONS`.
    batch : int
        Requests per trial.
    trials : int
        Random batches drawn.
    seed : int
        Seed of the one NumPy generator all trials draw from.

    Returns
    -------
    SimulationResult

    Raises
    ------
    ValueError
        An unknown ``distribution``.

    Examples
    --------
    >>> import bsrattn as ba
    >>> from bsrattn import makespan
    >>> rr = lambda qo, kv: ba.scheduler.round_robin(qo, kv, num_ctas=8)
    >>> makespan.compare(rr, rr, "U(512, 2048)", 16, trials=2, seed=0).ratios.tolist()
    [1.0, 1.0]
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; choose from {sorted(DISTRIBUTIONS)}")
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(trials):
        kv = DISTRIBUTIONS[distribution](rng, batch)
        qo = np.ones_like(kv)
        rr = makespan(baseline(qo, kv))
        ratios.append(rr / makespan(balanced(qo, kv)))
    return SimulationResult(distribution, batch, np.array(ratios))
