"""Where the "megabeta" loggers go in a run: rank 0 speaks, other ranks stay quiet unless
something is wrong (WARNING and above, prefixed with their rank so a reader knows who)."""

from __future__ import annotations

import logging
import sys

from megabeta.parallel.env import DistEnv

_LOG_HANDLER_MARK = "_megabeta_rank_handler"


def setup_logging(env: DistEnv, level: int = logging.INFO) -> logging.Logger:
    """Send the "megabeta" loggers to stdout: rank 0 at `level`, other ranks WARNING+ and prefixed.

    Calling it again replaces the handler it installed earlier rather than adding a second one.
    """
    logger = logging.getLogger("megabeta")
    for handler in [h for h in logger.handlers if getattr(h, _LOG_HANDLER_MARK, False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    setattr(handler, _LOG_HANDLER_MARK, True)
    prefix = "" if env.is_rank0 else f"[rank {env.rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(message)s",
                                           datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if env.is_rank0 else max(level, logging.WARNING))
    logger.propagate = False
    return logger
