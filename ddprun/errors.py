"""The one exception type that reaches the user as a message, never a traceback."""

from __future__ import annotations


class DdprunError(Exception):
    """Something went wrong that the user can act on. The CLI prints it and exits 1."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(DdprunError):
    """Bad input, detected before anything was started. Exit code 2."""

    exit_code = 2
