"""Notes logged once per process, not once per engine (a second LLM says nothing new)."""

import functools
import logging


@functools.cache
def log_once(logger: logging.Logger, level: int, message: str) -> None:
    logger.log(level, message)
