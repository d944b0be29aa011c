"""The benchmark suite: one script per workload of docs/benchmarks.md, a shared harness, plots and a report."""
