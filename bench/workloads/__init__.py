"""One module per workload; see :mod:`bench.harness` for what a workload module provides."""
