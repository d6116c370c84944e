"""Parallelism: rank discovery, process-group start-up and the wrappers built on them."""
