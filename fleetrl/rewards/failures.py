"""What counts as a failing scorer: the per-batch result type, hung-scorer streaks, and the failure-rate stop."""
from __future__ import annotations

from dataclasses import dataclass, field

from fleetrl.rewards.errors import ScorerFailureError

MAX_ERROR_MESSAGES = 5
# Three timeouts in a row with no call of that scorer returning in between: with the usual 4+ workers that is
# the first round of calls, and a scorer that hangs only on some inputs almost never strings three together.
HUNG_AFTER = 3


@dataclass
class RewardResult:
    """Per-sample scores (failed calls get the runner's default score) and what went wrong."""

    scores: list[float]
    num_errors: int = 0
    num_timeouts: int = 0
    errors: list[str] = field(default_factory=list)  # the first MAX_ERROR_MESSAGES messages
    extras: list[dict] = field(default_factory=list)  # per sample: the non-"score" keys a scorer returned
    num_skipped: int = 0  # samples not run: their scorer was found hung, or the batch already failed the rate
    samples_by_scorer: dict[str, int] = field(default_factory=dict)
    failed_by_scorer: dict[str, int] = field(default_factory=dict)  # errors + timeouts + skipped
    sources_by_scorer: dict[str, set[str]] = field(default_factory=dict)


class Tally:
    """Per-scorer counts within one batch: timeout streaks (hung?) and failures (certain to exceed the rate?)."""

    def __init__(self, specs: list[str], max_failure_rate: float) -> None:
        self.total: dict[str, int] = {}
        for spec in specs:
            self.total[spec] = self.total.get(spec, 0) + 1
        self.failed = dict.fromkeys(self.total, 0)
        self.streak = dict.fromkeys(self.total, 0)
        self.rate = max_failure_rate

    def returned(self, spec: str, failed: bool) -> None:
        self.streak[spec] = 0  # it answered (even with an error): not hung
        self.failed[spec] += failed

    def timed_out(self, spec: str) -> bool:
        """Counts a timeout; True the moment the scorer reaches HUNG_AFTER timeouts in a row."""
        self.failed[spec] += 1
        self.streak[spec] += 1
        return self.streak[spec] == HUNG_AFTER

    def skipped(self, spec: str) -> None:
        self.failed[spec] += 1

    def certain_to_fail(self) -> bool:
        return self.rate < 1.0 and any(self.failed[s] > self.rate * self.total[s] for s in self.total)


def check_failure_rate(result: RewardResult, max_rate: float, limit_note: str) -> None:
    """Raises ScorerFailureError naming every scorer that failed on more than max_rate of its samples."""
    if max_rate >= 1.0:
        return
    bad = [s for s, n in result.samples_by_scorer.items() if result.failed_by_scorer.get(s, 0) > max_rate * n]
    if not bad:
        return
    lines = [f"reward scorer {s!r} (data_source {', '.join(sorted(result.sources_by_scorer.get(s, ())))}) failed "
             f"on {result.failed_by_scorer[s]} of {result.samples_by_scorer[s]} samples" for s in bad]
    first = next((e for e in result.errors if any(repr(s) in e for s in bad)),
                 result.errors[0] if result.errors else "none recorded")
    # num_skipped holds both a hung scorer's calls (failures) and other scorers' calls dropped once the batch was
    # bound to fail (not failures); the message tells them apart.
    hung = sum(result.failed_by_scorer.values()) - result.num_errors - result.num_timeouts
    dropped = result.num_skipped - hung
    raise ScorerFailureError(
        "; ".join(lines) + f" in this batch ({result.num_errors} errors, {result.num_timeouts} timeouts, "
        f"{hung} not run after repeated timeouts" + (f", {dropped} of other scorers not run" if dropped else "")
        + f", {limit_note}), above rewards.max_failure_rate="
        f"{max_rate:g}. First failure: {first}. Fix the scorer (run it by hand on a few responses), raise "
        f"rewards.timeout_s if it is only slow, or set rewards.max_failure_rate=1.0 to keep training on "
        f"default scores")
