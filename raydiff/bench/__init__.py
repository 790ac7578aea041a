"""Benchmarks (`python -m raydiff.bench`): each prints numbers against a baseline measured in the same run."""
