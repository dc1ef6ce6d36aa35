"""The benchmark scripts, run as `python -m bench.<group>.<name>`; see bench/README.md."""
