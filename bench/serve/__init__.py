"""Benchmark scripts; see bench/README.md."""
