"""DataError: a problem in a user's data file or data config, reported so the user can fix it."""
from __future__ import annotations

from fleetrl.errors import UserError


class DataError(UserError, ValueError):
    """A data file or data setting is wrong; the message names the file, row and field and says how to fix it."""


def row_error(file: str, row: int, field: str, problem: str, fix: str) -> DataError:
    """Builds the one message shape every per-row error uses, so users can grep for `row N (0-based)`."""
    return DataError(f"{file}: row {row} (0-based), field {field!r}: {problem}. {fix}")
