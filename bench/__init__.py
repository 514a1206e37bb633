"""Benchmarks: `python -m bench.all` runs every `bench.*` module and records bench/results.jsonl."""
