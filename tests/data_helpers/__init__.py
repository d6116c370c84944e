"""Shared helpers of the data-pipeline tests (tests/test_data_*.py)."""
