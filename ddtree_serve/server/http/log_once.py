"""Log a note about a request once per server, not once per request: what the server accepts without acting
on it (an Anthropic ``thinking`` request to a model that cannot think, an unknown body field, a built-in tool
it cannot run). The set of notes already logged lives in the ``LogOnce`` object a handler holds (the app's
state), never at module level."""

from __future__ import annotations

import logging


class LogOnce:
    """Logs each key's message the first time the key is seen (at INFO on ``logger``)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()

    def __call__(self, key: str, message: str) -> bool:
        """Log ``message`` unless ``key`` was logged before; True when it was logged now."""
        if key in self._seen:
            return False
        self._seen.add(key)
        self._logger.info("%s (logged once)", message)
        return True

    def all(self, notes: list[tuple[str, str]]) -> None:
        """Log each ``(key, message)`` of ``notes`` once."""
        for key, message in notes:
            self(key, message)
