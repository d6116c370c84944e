"""The run's logging: rank 0 logs; other ranks only warnings and errors, with their rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from megabeta.parallel.env import DistEnv
from megabeta.train.logs import setup_logging


@pytest.fixture
def megabeta_logger() -> Iterator[logging.Logger]:
    """The "megabeta" logger, put back as found so other tests' caplog still sees its records."""
    logger = logging.getLogger("megabeta")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def test_logging_rank0_info_others_warnings_with_rank(
        megabeta_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    log = logging.getLogger("megabeta.test")
    assert setup_logging(DistEnv(0, 2, 0, 2, "h", 1, "torchrun")) is megabeta_logger
    log.info("hello from zero")
    setup_logging(DistEnv(1, 2, 1, 2, "h", 1, "torchrun"))  # replaces, does not add, a handler
    log.info("hidden info")
    log.warning("disk almost full")
    out = capsys.readouterr().out
    assert "hello from zero" in out and "hidden info" not in out
    assert "[rank 1] disk almost full" in out and out.count("disk almost full") == 1
