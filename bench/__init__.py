"""Benchmarks of afkmemory against its peers: ``python -m bench.run`` (see BENCHMARKS.md)."""
