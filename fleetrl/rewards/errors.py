"""RewardError: a reward configuration problem (scorer spec, data_source routing) the user can fix."""
from __future__ import annotations

from fleetrl.errors import UserError


class RewardError(UserError, ValueError):
    """A reward setting is wrong; the message says what was found, what was expected and what to change."""
