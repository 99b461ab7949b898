"""Measurement tools behind the CLI: ``bench`` (the benchmark table), ``parity`` (greedy parity),
``exactness`` (chi-square tests, the toy sampler and the lossy negative control).
"""
