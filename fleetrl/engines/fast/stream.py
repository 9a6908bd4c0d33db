"""Continuous batching across generate calls, with weights updated in flight (`trainer.stream_rollouts`).

Why: an async rollout worker used to run its calls one after another, each to its longest sample. With long-tailed
responses (a few clipped at 4,096 tokens among ~1,000-token ones) every call ends in a tail where a handful of
samples decode in an otherwise empty engine, so generation costs ~4,096 sequential decode steps per call whatever
its batch, and no split of the GPUs gets async past the synchronous step (docs/async.md, "What bounds async").
Here the next calls' samples take the slots the finishing ones free, so the engine stays full.

How: one engine thread per rollout worker runs the engine's continuous-batching loop (batching.py, which
`FastRolloutEngine._run` runs over one call) with its waiting queue fed by every call; a
call's thread waits until its last sample finishes and gets its own `GenerationOutput`. Between two decode rounds
the thread installs weights published since (`install`: the worker's load of the newest offered version, in place,
then the engine's fused and cast copies refreshed in place, so captured CUDA graphs stay valid) and the running
samples go on decoding with them, their KV caches as they are: no re-prefill (PipelineRL's in-flight weight
updates, Piché et al. 2025). Each token records the version of the weights that sampled it (`token_versions`) and
the log-prob it was sampled with, which the rollout correction weighs; a sample's version only grows, so its first
token is its oldest, and that is at least the version its call was tagged with (a call waits until the engine holds
it): the schedule's staleness bound holds per token as with partial rollouts.

Samples of different calls share one sampler setting (temperature, top-p, top-k, stop ids): an async run's calls
do. A call whose setting differs (validation's greedy calls) and any `exclusive` task (a weights load from another
thread) wait until the running samples finish. A request's random stream is keyed by its call's seed and its index
in the call (`request_key`), so samples do not depend on which slot or call order they get; which version samples
which token depends on timing, so a streamed run is not reproducible number for number.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fleetrl.engines.fast.batching import SlotLoop
from fleetrl.engines.fast.postprocess import assemble_output
from fleetrl.engines.protocol import GenerationOutput, SamplingParams, response_limits

WAIT_S = 1.0  # the idle engine thread looks at its queue at least this often (an offer also wakes it: `poke`)


def request_key(seed: int, index: int) -> int:
    """A 31-bit key of (call seed, index in the call): what keys a streamed sample's random draws (sampling.py)."""
    h = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    h ^= h >> 31
    h = (h * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (h ^ (h >> 32)) & 0x7FFFFFFF


@dataclass(eq=False)
class _Call:
    rows: list[torch.Tensor]
    limits: list[int]
    params: SamplingParams
    min_version: int
    done: threading.Event = field(default_factory=threading.Event)
    left: int = 0
    tok: dict[int, torch.Tensor] = field(default_factory=dict)
    lp: dict[int, torch.Tensor] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    switches: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # index -> [(first token, version)]
    error: BaseException | None = None


@dataclass(eq=False)
class _Task:
    """Work that needs the engine to itself (a weights load from another thread): run between sessions."""
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


def _sampler_of(params: SamplingParams) -> tuple:
    return params.temperature, params.top_p, params.top_k, tuple(sorted(params.stop_token_ids))


class EngineStream:
    """The engine thread and its queue (module docstring). `install()` brings the engine to the newest weights
    offered to its worker (a no-op when it holds them); it runs on the engine thread."""

    def __init__(self, engine: Any, install: Callable[[], None], seed: int = 0) -> None:
        from fleetrl.models.lora import lora_layers

        if lora_layers(engine.model):
            # An in-flight install refreshes the engine's copies but merges no adapters; a streamed (async) rollout
            # pool's model is plain and receives merged weights, so this never arises from a config.
            raise ValueError("EngineStream serves a plain model: this engine's model carries LoRA adapters; merge "
                             "them into the weights the stream installs (the async weight path sends them merged)")
        self.engine, self.install, self.seed = engine, install, seed
        self._cv = threading.Condition()
        self._queue: deque[_Call | _Task] = deque()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self.stats = {"sessions": 0, "calls": 0, "installs": 0, "in_flight_installs": 0}
        self._idle_s = 0.0  # seconds the engine thread waited with nothing it could run, since `take_idle_s`
        self._offered = 0  # the newest weights version offered to this worker (`poke`)
        self._poked = False  # an offer since the engine thread last looked (so a wait never misses one)

    # ------------------------------------------------------------------------------------------ callers
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 min_version: int = 0) -> tuple[GenerationOutput, torch.Tensor]:
        """One call's samples through the stream, once the engine holds weights version >= min_version ->
        (output, token_versions [B, R] long: the version that sampled each token, 0 past a response's end)."""
        if len(prompts) == 0:
            raise ValueError("EngineStream.generate: a call needs at least one prompt")
        with self._cv:
            known = max(self._offered, self.engine.weights_version)
        if min_version > known:  # as the one-call path says: nothing will ever bring the engine there
            raise RuntimeError(f"the call needs weights version {min_version}, but the newest offered to this rollout "
                               f"worker is {known}: weight sync did not arrive")
        rows = self.engine._unpad(prompts, prompt_mask, params)
        call = _Call(rows, response_limits(params, len(rows)).tolist(), params, min_version)
        self._submit(call)
        return self._assemble(call)

    def exclusive(self, fn: Callable[[], Any]) -> Any:
        """fn() on the engine thread while no sample runs (FIFO with the calls); from the engine thread itself, now."""
        if threading.current_thread() is self._thread:
            return fn()
        task = _Task(fn)
        self._submit(task)
        return task.result

    def take_idle_s(self) -> float:
        """Seconds the engine sat with nothing to run since the last call of this (an async rollout pool's idle)."""
        with self._cv:
            idle, self._idle_s = self._idle_s, 0.0
        return idle

    def poke(self, version: int = 0) -> None:
        """Weights `version` were offered (or have arrived): a call tagged with it may wait for it, and an idle
        engine thread looks at its queue again."""
        with self._cv:
            self._offered = max(self._offered, version)
            self._poked = True
            self._cv.notify_all()

    def _submit(self, item: _Call | _Task) -> None:
        with self._cv:
            if self._failed is not None:
                raise RuntimeError(f"the rollout engine's stream failed earlier: {self._failed!r}") from self._failed
            self._queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True, name="fleetrl-engine-stream")
                self._thread.start()
            self._cv.notify_all()
        # No deadline here: this thread is a worker call's, which the driver's watchdog bounds (the verb's call
        # deadline, and the heartbeat the engine thread moves every decode round: a frozen loop is a StallError
        # naming the worker); a call whose weights were never offered fails before it queues (`generate`).
        item.done.wait()
        if item.error is not None:
            raise item.error

    # ------------------------------------------------------------------------------------- engine thread
    def _serve(self) -> None:
        live: list[_Call] = []
        try:
            while True:
                with self._cv:
                    t0 = time.perf_counter()
                    while not self._queue:
                        self._cv.wait(WAIT_S)
                    self._idle_s += time.perf_counter() - t0
                self._install()
                first = self._first_startable()
                if isinstance(first, _Task):
                    self._run_task(first)
                elif first is None or not self._session(live):
                    with self._cv:  # every queued call waits for weights not arrived yet: wait for them
                        t0 = time.perf_counter()
                        if not self._poked:
                            self._cv.wait(WAIT_S)
                        self._poked = False
                        self._idle_s += time.perf_counter() - t0
        except BaseException as err:  # every waiting caller gets the error; later ones too (`_submit`)
            with self._cv:
                self._failed = err
                waiting = [*live, *self._queue]
                self._queue.clear()
            for item in waiting:
                item.error = err
                item.done.set()

    def _install(self) -> bool:
        """The newest arrived weights into the engine (`install`); whether the version moved."""
        before = self.engine.weights_version
        self.install()
        moved = self.engine.weights_version != before
        self.stats["installs"] += moved
        return moved

    def _first_startable(self) -> _Call | _Task | None:
        """The first queued task, or call whose weights the engine holds (calls waiting for newer ones are passed)."""
        with self._cv:
            return next((item for item in self._queue
                         if isinstance(item, _Task) or item.min_version <= self.engine.weights_version), None)

    def _run_task(self, task: _Task) -> None:
        with self._cv:
            self._queue.remove(task)
        try:
            task.result = task.fn()
        except BaseException as err:  # the caller's error, not the stream's; its caller is woken either way
            task.error = err
        task.done.set()

    def _take(self, sampler: tuple | None, version: int) -> tuple[tuple | None, list[_Call]]:
        """The queued calls that may join a session of `sampler` (None: the first startable call's) now, in order:
        a call tagged with weights newer than `version` is passed over (it waits for them), a call of another
        sampler setting or a task is a barrier (what follows it waits too, so nothing overtakes it for long)."""
        taken: list[_Call] = []
        with self._cv:
            for item in self._queue:
                if isinstance(item, _Task):
                    break
                if item.min_version > version:
                    continue
                if sampler is None:
                    sampler = _sampler_of(item.params)
                elif _sampler_of(item.params) != sampler:
                    break
                taken.append(item)
            for call in taken:
                self._queue.remove(call)
        return sampler, taken

    def _session(self, live: list[_Call]) -> bool:
        """Runs calls of one sampler setting until no sample is left and no queued call may join; False when none
        could start (the head call waits for weights not offered yet)."""
        e = self.engine
        self._install()
        sampler, calls = self._take(None, e.weights_version)
        if not calls:
            return False
        live.extend(calls)  # from here on an error reaches their callers (`_serve`)
        head = calls[0]
        self.stats["sessions"] += 1
        try:
            self._run_session(calls, sampler, head, live)
        finally:
            e._end()  # what a call frees at its end (a CPU's per-call bf16 copy), a session frees at its end
        return True

    def _run_session(self, calls: list[_Call], sampler: tuple | None, head: _Call, live: list[_Call]) -> None:
        e = self.engine
        buf, key = e._begin(e.max_batch, e.max_seq_len, head.params)  # as a call begins: the same order
        buf.seed.fill_(self.seed)  # each request's own key (request_key) carries its call's seed
        loop = SlotLoop(e, buf, key)
        owner: dict[int, tuple[_Call, int]] = {}  # request id -> (its call, its index there)

        def admitted(rid: int) -> None:  # its first token is sampled by the weights the engine holds now
            call, index = owner[rid]
            call.switches[index] = [(0, e.weights_version)]

        pending: deque[int] = deque()
        while calls or pending or loop.running:
            for call in calls:
                if call not in live:
                    live.append(call)
                self._enqueue(call, pending, loop, owner)
            rids, counts, toks, lps = loop.round(pending, on_admit=admitted)
            for i, rid in enumerate(rids):
                self._finish_request(*owner.pop(rid), counts[i], toks[i], lps[i], live)
            if self._install():  # in flight: the running samples continue on the newest weights
                e._prepare_weights()
                self.stats["in_flight_installs"] += 1
                for slot, rid in loop.running.items():
                    call, index = owner[rid]
                    call.switches[index].append((loop.sampled[slot], e.weights_version))
            loop.compact_if_idle(pending)
            calls = self._take(sampler, e.weights_version)[1]

    def _enqueue(self, call: _Call, pending: deque[int], loop: SlotLoop, owner: dict[int, tuple[_Call, int]]) -> None:
        call.left = len(call.rows)
        self.stats["calls"] += 1
        for index, row in enumerate(call.rows):
            rid = loop.new_request(row, call.limits[index], request_key(call.params.seed or 0, index))
            owner[rid] = (call, index)
            pending.append(rid)

    def _finish_request(self, call: _Call, index: int, count: int, tok: torch.Tensor, lp: torch.Tensor,
                        live: list[_Call]) -> None:
        """Records a finished request; its call's thread assembles the output once the last one is in (no device
        sync or tokenizer work on the engine thread, whose decoding the other calls wait on)."""
        call.tok[index], call.lp[index], call.counts[index] = tok, lp, count
        call.left -= 1
        if not call.left:
            live.remove(call)
            call.done.set()

    def _assemble(self, call: _Call) -> tuple[GenerationOutput, torch.Tensor]:
        n, width = len(call.rows), max(call.limits)
        e = self.engine
        # each request's row is as wide as the widest limit harvested with it: pad to the call's widest
        toks = torch.zeros(n, width, dtype=torch.long, device=call.tok[0].device)
        lps = torch.zeros(n, width, dtype=torch.float32, device=call.tok[0].device)
        for i in range(n):
            k = min(width, len(call.tok[i]))
            toks[i, :k], lps[i, :k] = call.tok[i][:k], call.lp[i][:k]
        stop = set(e._eos) | set(call.params.stop_token_ids)
        out = assemble_output(toks, lps, [call.counts[i] for i in range(n)], stop, call.params.stop_strings,
                              e.tokenizer, call.rows[0].device)
        return out, _versions(call, out.responses.shape[1]) * out.response_mask


def _versions(call: _Call, width: int) -> torch.Tensor:
    """[B, width] long: token t of sample i was sampled by the version of the last switch at or before t."""
    out = torch.zeros(len(call.rows), width, dtype=torch.long)
    for i, switches in call.switches.items():
        for start, version in switches:
            if start < width:
                out[i, start:] = version
    return out
