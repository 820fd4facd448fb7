"""``ServerError``: the one error of launching, probing and talking to a vLLM server."""

from __future__ import annotations


class ServerError(Exception):
    """Starting or talking to the server failed. ``str(exc)`` is one line; ``log_tail`` has context."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


__all__ = ["ServerError"]
