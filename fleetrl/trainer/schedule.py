"""The async pipeline's bookkeeping, pure (no Ray, no tensors): which generate calls ("chunks") may start, which
one a step takes next, and whether a finished one is fresh enough to train on.

Versions: the rollout's weights start at version 0 and every step's sync publishes one more, so step s (1-based)
trains the policy of version s-1, and a sample generated at version v has staleness (s-1) - v.

Why staleness never exceeds k = max_staleness under `hold`: chunks are submitted only right after a publish, while
at most (k+1)·P groups (P = groups per step) are outstanding (submitted, neither trained on nor dropped). A chunk
submitted at version v therefore has at most (k+1)·P groups before it, itself included, that no step has taken
yet; steps v+1 .. v+k+1 take at least P groups each, oldest first, so it is taken by step v+k+1 at the latest:
staleness <= (v+k) - v = k. With k = 0 this is exactly the synchronous schedule: one step's generation, at the
version the step trains.

Partial rollouts (trainer.partial_rollouts, workers/partial.py) bound staleness per token: a chunk's call may
install newer weights between its segments, so its tokens carry versions >= the chunk's; the version a step checks
(`Window.take`) is the chunk's oldest token's, and the argument above, made for the chunk's version, covers every
token of it. No token older than k versions behind the version trained is trained.

`drop` takes chunks in the order they finish instead, so a slow generation never holds the trainer; one that
finishes after its version fell more than k behind is dropped (counted), and its room in the window refilled.

Resume (`PromptLedger`): a checkpoint keeps no generation, but it keeps the prompts of every chunk no step has taken
yet, oldest first, and the sampler after its last draw. The resumed run submits those prompts again, in that order,
before it draws new ones: every drawn prompt is taken by exactly one step across any number of resumes (trained, or
dropped as too stale under `drop`), and under `hold` each step trains the same prompts as an uninterrupted run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from fleetrl.config.async_plan import AsyncPlan


@dataclass(frozen=True)
class Chunk:
    seq: int
    """Submission order, from 0 over the run (or since the resume)."""
    version: int
    """The weights version the chunk is tagged with: its call installs that version first when the engine holds
    an older one, so the version it records is this or newer."""
    groups: int


class Window:
    def __init__(self, plan: AsyncPlan) -> None:
        self.plan = plan
        self.outstanding: dict[int, Chunk] = {}  # seq -> chunk, submitted and not yet taken (insertion = seq order)
        self.next_seq = 0
        self.dropped_groups = 0

    @property
    def open_groups(self) -> int:
        return sum(c.groups for c in self.outstanding.values())

    def fill(self, version: int) -> list[Chunk]:
        """The chunks to submit now, right after version `version` was published: up to the window."""
        new = []
        while self.open_groups + self.plan.chunk_groups <= self.plan.window_groups:
            new.append(self._add(version))
        return new

    def refill(self, version: int) -> Chunk | None:
        """One more chunk for a step that is still short (dynamic sampling) when nothing is outstanding. One at a
        time: a chunk the step then does not need would be taken by the next step, one version staler."""
        return None if self.outstanding else self._add(version)

    def _add(self, version: int) -> Chunk:
        chunk = Chunk(seq=self.next_seq, version=version, groups=self.plan.chunk_groups)
        self.outstanding[chunk.seq] = chunk
        self.next_seq += 1
        return chunk

    def pick(self, finished: Sequence[int]) -> Chunk | None:
        """The chunk the step takes next, given the seqs of outstanding chunks whose results are in (in the order
        they finished); None = wait for more. hold: the oldest outstanding, once finished; drop: the first done."""
        if not finished:
            return None
        if self.plan.stale == "drop":
            return self.outstanding[finished[0]]
        head = next(iter(self.outstanding))
        return self.outstanding[head] if head in finished else None

    def take(self, chunk: Chunk, recorded_version: int, trained_version: int) -> bool:
        """Removes the chunk from the window; True = train on it, False = dropped as too stale (drop only).
        recorded_version: the oldest version the chunk's samples recorded, per token with partial rollouts."""
        del self.outstanding[chunk.seq]
        if trained_version - recorded_version <= self.plan.max_staleness:
            return True
        # Under hold the invariant in the module docstring makes this unreachable; if it is reached the
        # bookkeeping is wrong, and training on the sample would break the promised bound.
        assert self.plan.stale == "drop", (f"chunk {chunk.seq} of version {recorded_version} reached step training "
                                           f"version {trained_version}: staleness above max_staleness="
                                           f"{self.plan.max_staleness} under stale=hold")
        self.dropped_groups += chunk.groups
        return False


Key = tuple[str, int]
"""A prompt: (task, index in that task's dataset), as the sampler draws it (data/sampler.py)."""


class PromptLedger:
    """The prompts the window holds: drawn, submitted, not yet taken by a step; and the prompts a checkpoint
    handed back, submitted again before anything new is drawn."""

    def __init__(self) -> None:
        self.chunks: dict[int, list[Key]] = {}  # seq -> the prompts of a chunk no step has taken yet
        self.requeued: list[Key] = []  # from a checkpoint, not yet submitted again

    def draw(self, seq: int, groups: int, fresh: Callable[[int], list[Key]]) -> list[Key]:
        """The prompts of chunk `seq`: handed-back ones first, then `fresh(k)` (the sampler's next k)."""
        keys, self.requeued = self.requeued[:groups], self.requeued[groups:]
        if len(keys) < groups:
            keys += fresh(groups - len(keys))
        self.chunks[seq] = keys
        return keys

    def taken(self, seq: int) -> None:
        """A step took chunk `seq` (trained on it, or dropped it as too stale): its prompts are spent."""
        del self.chunks[seq]

    def untaken(self) -> list[Key]:
        """What a checkpoint saves: every prompt drawn and not taken, in the order it was first drawn (chunks in
        submission order; handed-back prompts still waiting were drawn before any chunk's fresh ones, and come
        after the chunks, which took theirs from the front of the same list)."""
        return [k for seq in sorted(self.chunks) for k in self.chunks[seq]] + self.requeued

    def hand_back(self, keys: Sequence[Key]) -> None:
        """A resumed run's start: `keys` (a checkpoint's `untaken()`) go out again before any new draw."""
        assert not self.chunks, "prompts are handed back before the first chunk is submitted"
        self.requeued = [(str(t), int(i)) for t, i in keys]


def staleness_bound_holds(trained_versions: Sequence[int], sample_versions: Sequence[Sequence[int]],
                          max_staleness: int) -> bool:
    """The promise, on recorded versions: for every step, every sample's version v has 0 <= trained - v <= k."""
    return all(0 <= t - v <= max_staleness for t, vs in zip(trained_versions, sample_versions, strict=True)
               for v in vs)


def token_bound_holds(trained_versions: Sequence[int], token_versions: Sequence[Sequence[Sequence[int]]],
                      max_staleness: int) -> bool:
    """The promise per token (partial rollouts): for every step, every token of every trained response was
    generated at a version v with 0 <= trained - v <= k. token_versions[step][sample] = that sample's tokens'."""
    return all(0 <= t - v <= max_staleness for t, samples in zip(trained_versions, token_versions, strict=True)
               for tokens in samples for v in tokens)
