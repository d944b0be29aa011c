"""The benchmark suite: one script per workload of BENCHMARKS.md, a shared harness, plots and a report."""
