"""Resume accounting of the async pipeline (trainer/schedule.py PromptLedger, trainer/pipeline.py checkpoint_state
/ restore) and prompts.jsonl (trainer/prompt_log.py), with hand-computed expectations: a checkpoint hands back every
drawn prompt no step has taken, so a resumed run trains each prompt of an epoch exactly once, under hold in the
same steps as an uninterrupted run, and under drop too where the old resume point trained one prompt twice."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from fleetrl.config.async_plan import AsyncPlan
from fleetrl.data.sampler import MixtureSampler
from fleetrl.trainer.prompt_log import PromptLog, parse, trained_prompts
from fleetrl.trainer.schedule import PromptLedger, Window


def _plan(k: int, *, P: int, G: int = 1, stale: str = "hold") -> AsyncPlan:
    return AsyncPlan(max_staleness=k, stale=stale, groups_per_step=P, chunk_groups=G, window_groups=(k + 1) * P,
                     max_chunks_per_step=P // G)


def _sampler() -> MixtureSampler:
    return MixtureSampler({"t": 6}, None, seed=0, shuffle=False)  # draws 0, 1, ..., 5, 0, 1, ...


class _Controller:
    """The pipeline's bookkeeping without Ray: chunks "finish" in `finish_order` (seqs, default submission order)."""

    def __init__(self, plan: AsyncPlan, finish_order: list[int] | None = None) -> None:
        self.plan, self.window, self.ledger, self.sampler = plan, Window(plan), PromptLedger(), _sampler()
        self.version, self.keys, self.versions, self.finish_order = 0, {}, {}, finish_order

    def fill(self) -> None:
        for chunk in self.window.fill(self.version):
            self.keys[chunk.seq] = self.ledger.draw(chunk.seq, chunk.groups, self.sampler.next_indices)
            self.versions[chunk.seq] = chunk.version

    def step(self) -> list[int]:
        """One step: the indices of the prompts it trained; then the sync (version + 1) and the refill."""
        trained: list[int] = []
        while len(trained) < self.plan.groups_per_step:
            order = [s for s in (self.finish_order or sorted(self.window.outstanding)) if s in self.window.outstanding]
            chunk = self.window.pick(order[:1] if self.plan.stale == "drop" else order)
            self.ledger.taken(chunk.seq)
            if self.window.take(chunk, self.versions[chunk.seq], self.version):
                trained += [i for _, i in self.keys[chunk.seq]]
        self.version += 1
        self.fill()
        return trained

    def checkpoint(self) -> dict:
        return {"untaken": self.ledger.untaken(), "sampler": copy.deepcopy(self.sampler.state_dict()),
                "seq": min(self.ledger.chunks, default=self.window.next_seq), "version": self.version}

    @classmethod
    def resumed(cls, plan: AsyncPlan, state: dict) -> _Controller:
        c = cls(plan)
        c.sampler.load_state_dict(state["sampler"])
        c.ledger.hand_back(state["untaken"])
        c.window.next_seq, c.version = state["seq"], state["version"]
        c.fill()
        return c


def _run(plan: AsyncPlan, steps: int, *, kill_after: int | None = None, finish_order=None) -> list[list[int]]:
    c = _Controller(plan, finish_order)
    c.fill()
    out = []
    for s in range(1, steps + 1):
        out.append(c.step())
        if s == kill_after:
            c = _Controller.resumed(plan, c.checkpoint())  # a fresh process: nothing survives but the checkpoint
    return out


@pytest.mark.parametrize("k,G,kill_after", [(1, 1, 1), (1, 2, 2), (2, 1, 1), (2, 2, 3)])
def test_hold_resume_trains_the_same_prompts_in_the_same_steps(k, G, kill_after):
    plan = _plan(k, P=2, G=G)
    # 6 prompts, 2 a step, in order: an epoch is 3 steps.
    expected = [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]]
    assert _run(plan, 6) == expected
    assert _run(plan, 6, kill_after=kill_after) == expected


def test_the_checkpoint_holds_the_window_oldest_first():
    # k=1, P=2, G=1: the first fill submits seqs 0-3 (prompts 0-3); step 1 takes 0, 1; the refill at version 1
    # submits seqs 4, 5 (prompts 4, 5). The checkpoint: prompts 2-5, the sampler after 6 draws, oldest seq 2.
    c = _Controller(_plan(1, P=2))
    c.fill()
    assert c.step() == [0, 1]
    state = c.checkpoint()
    assert state["untaken"] == [("t", 2), ("t", 3), ("t", 4), ("t", 5)]
    assert state["seq"] == 2 and state["sampler"]["draws"] == 6
    r = _Controller.resumed(_plan(1, P=2), state)
    assert {s: [i for _, i in r.keys[s]] for s in r.window.outstanding} == {2: [2], 3: [3], 4: [4], 5: [5]}


def test_drop_resume_trains_nothing_twice():
    # k=1, P=1, G=1, drop; chunk 1 finishes before chunk 0. Step 1 takes seq 1 (prompt 1); the refill submits seq 2
    # (prompt 2). Untaken at the checkpoint: prompts 0 and 2. Resumed: seq 0 -> prompt 0, seq 1 -> prompt 2, then
    # prompts 3, 4, 5. A resume point (the sampler before prompt 0) would have drawn 0, 1, 2: prompt 1 twice.
    order = [1, 0, 2, 3, 4, 5, 6, 7]
    assert _run(_plan(1, P=1, stale="drop"), 6, finish_order=order) == [[1], [0], [2], [3], [4], [5]]
    assert _run(_plan(1, P=1, stale="drop"), 6, kill_after=1) == [[0], [1], [2], [3], [4], [5]]
    killed = _run(_plan(1, P=1, stale="drop"), 6, kill_after=1, finish_order=order)
    assert sorted(i for step in killed for i in step) == [0, 1, 2, 3, 4, 5]


def test_ledger_hands_back_before_drawing_and_keeps_the_order():
    ledger = PromptLedger()
    ledger.hand_back([["t", 7], ["t", 8], ["t", 9]])  # as torch.load gives them back: lists
    fresh = iter(range(100))
    draw = lambda k: [("t", next(fresh)) for _ in range(k)]  # noqa: E731
    assert ledger.draw(0, 2, draw) == [("t", 7), ("t", 8)]
    assert ledger.untaken() == [("t", 7), ("t", 8), ("t", 9)]
    assert ledger.draw(1, 2, draw) == [("t", 9), ("t", 0)]
    ledger.taken(0)
    assert ledger.untaken() == [("t", 9), ("t", 0)]
    with pytest.raises(AssertionError):
        ledger.hand_back([("t", 1)])  # only before the first submission


def test_pipeline_checkpoint_state_round_trip():
    # AsyncRollouts' own save and restore, with its Ray parts stubbed: the resumed pipeline submits the saved
    # prompts under their old seqs, then draws on from the saved sampler; the plain part stays a sampler state.
    from fleetrl.trainer.pipeline import AsyncRollouts

    def pipeline(state: dict | None = None) -> tuple[AsyncRollouts, list]:
        p = object.__new__(AsyncRollouts)
        p.p = _plan(1, P=2)
        p.window, p.ledger, p.resume_points, p.restored_point = Window(p.p), PromptLedger(), {}, None
        p.feed = SimpleNamespace(sampler=_sampler())
        p.started, p.version = False, 0
        submitted: list = []

        def submit(chunk) -> None:  # _submit's accounting (its _draw), without the generate call
            keys = p._draw(chunk)
            submitted.append((chunk.seq, p.resume_points[chunk.seq]["draws"], keys))

        p._submit = submit
        if state is not None:
            p.restore(state)
        return p, submitted

    p, submitted = pipeline()
    p._fill()
    assert submitted == [(0, 0, [("t", 0)]), (1, 1, [("t", 1)]), (2, 2, [("t", 2)]), (3, 3, [("t", 3)])]
    for seq in (0, 1):  # step 1 takes seqs 0 and 1
        p.window.take(p.window.outstanding[seq], 0, 0)
        p.resume_points.pop(seq)
        p.ledger.taken(seq)
    state = copy.deepcopy(p.checkpoint_state())
    assert state["draws"] == 2  # the resume point: before prompt 2, the oldest untaken
    assert state["pipeline"]["untaken"] == [["t", 2], ["t", 3]] and state["pipeline"]["seq"] == 2
    assert state["pipeline"]["sampler"]["draws"] == 4

    q, resubmitted = pipeline(state)
    assert q.checkpoint_state()["draws"] == 2  # nothing submitted yet: still the checkpoint's resume point
    q._fill()
    assert resubmitted == [(2, 2, [("t", 2)]), (3, 2, [("t", 3)]), (4, 4, [("t", 4)]), (5, 5, [("t", 5)])]

    old, _ = pipeline({k: v for k, v in state.items() if k != "pipeline"})  # a checkpoint without the part
    assert old.feed.sampler.state_dict()["draws"] == 2 and not old.ledger.requeued


def test_prompt_log_supersedes_after_a_resume(tmp_path):
    log = PromptLog(tmp_path)
    log.resumed(0)  # no file yet: nothing written
    assert not (tmp_path / "prompts.jsonl").exists()
    for s, uids in ((1, ["a", "b"]), (2, ["c", "d"]), (3, ["e", "f"])):
        log.step(s, uids)
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write('{"step": 4, "prom')  # a line a SIGKILL cut short
    log.resumed(2)  # the checkpoint of step 2: steps 3 and 4 of the killed run are superseded
    log.step(3, ["e", "f"])
    log.step(4, ["a", "b"])
    assert trained_prompts(tmp_path) == {1: ["a", "b"], 2: ["c", "d"], 3: ["e", "f"], 4: ["a", "b"]}
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    assert lines[3] == '{"step": 4, "prom' and lines[4] == '{"event": "resumed", "supersedes_after": 2}'


def test_prompt_log_parse_rules():
    lines = ['{"step": 1, "prompts": ["a"]}', '{"step": 2, "prompts": ["b"]}', '{"step": 3, "prompts": ["c"]}',
             '{"event": "resumed", "supersedes_after": 1}', '{"step": 2, "prompts": ["x"]}',
             '{"event": "resumed", "supersedes_after": 0}', '{"step": 1, "prompts": ["y"]}', "not json", "[1]"]
    assert parse(lines) == {1: ["y"]}
    assert parse(lines[:5]) == {1: ["a"], 2: ["x"]}


def test_a_run_without_the_file_trained_nothing_recorded(tmp_path):
    assert trained_prompts(tmp_path) == {}
