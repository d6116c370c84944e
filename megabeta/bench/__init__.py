"""Benchmarks that print figures: `python -m megabeta.bench {model,data}`."""
