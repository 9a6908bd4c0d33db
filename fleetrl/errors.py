"""The one family of errors a user can cause and fix. The CLI prints any `UserError` as one line
(`error: ...`, exit code 2); every other exception is a bug and keeps its traceback.

Each subclass lives beside its owner (ConfigError in config/, DataError in data/, ...) and also derives from the
builtin it replaced, so `except ValueError` in older code keeps working.
"""
from __future__ import annotations


class UserError(Exception):
    """Something the user wrote or set up is wrong; the message names it, says what was expected and how to fix it."""
