"""Exercise 16, solved: a plan's makespan, and the bound no assignment beats."""


def makespan(plan):  # plan: a ba.scheduler.WorkPlan
    """The largest CTA load of ``plan``, a float."""
    loads = [int(plan.item_cost[plan.cta_indptr[c]:plan.cta_indptr[c + 1]].sum()) for c in range(plan.num_ctas)]
    return float(max(loads, default=0))


def lower_bound(costs, num_ctas):  # costs [W]
    """``max(sum(costs) / num_ctas, max(costs))``, a float (0.0 without items)."""
    return float(max(sum(costs) / num_ctas, max(costs, default=0)))
