"""Benchmarks: `python -m bench.all` runs every `bench.*` module and records bench/results.jsonl."""
import inference  # noqa: F401  first: it sets the OpenMP spin before a benchmark loads torch
