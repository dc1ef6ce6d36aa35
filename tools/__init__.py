"""Generators and helpers for tests and benchmarks: synthetic models, the upcycler, the memory-limit runner."""
