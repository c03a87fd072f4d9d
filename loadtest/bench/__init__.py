"""Benchmarks and profilers, one command each (``python -m loadtest.bench.X``); their results
go to BENCHMARKS.md."""
