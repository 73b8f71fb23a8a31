"""The project's tools (weights, streams, benchmarks, roll/backup); each runs as `python scripts/NAME.py` or as the
console script pyproject.toml names."""
