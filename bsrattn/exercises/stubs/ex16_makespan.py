"""The makespan of a plan: when its busiest CTA finishes, under the cost model; and how early it could.

CTA c runs the items plan.cta_indptr[c] : plan.cta_indptr[c + 1], item w costing plan.item_cost[w]. The CTAs run
side by side, so the step ends when the most loaded one does:

    CTA 0  █████████████████████████████  29
    CTA 1  █████████████████████████████  29         makespan 29
    CTA 2  █████████████████████████████  29
    CTA 3  ████████████████████████████   28

No assignment of the same items to num_ctas CTAs finishes before max(sum(costs) / num_ctas, max(costs)): the work
must be shared out, and the longest item runs on one CTA. Write both, then compare one CTA per request
(`ba.scheduler.round_robin`) with Algorithm 1 (`ba.scheduler.plan`) against the bound.

Check it: python -m bsrattn.exercises check 16
"""


def makespan(plan):  # plan: a ba.scheduler.WorkPlan
    """The largest CTA load of ``plan``, a float."""
    raise NotImplementedError("exercise 16: sum each CTA's item costs, take the largest")


def lower_bound(costs, num_ctas):  # costs [W]
    """``max(sum(costs) / num_ctas, max(costs))``, a float (0.0 without items)."""
    raise NotImplementedError("exercise 16: the average load, or the longest item if it is longer")
