"""Benchmark clients; ``web.bench.serve`` is ``tailrace bench serve``."""
