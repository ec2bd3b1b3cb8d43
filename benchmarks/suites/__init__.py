"""Benchmark suites run by ``python -m benchmarks.run`` (see ``benchmarks/harness.py``)."""
