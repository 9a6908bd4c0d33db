"""The fast engine's continuous-batching loop, one round at a time: `FastRolloutEngine._run` drives it over one
call's requests, `stream.EngineStream` over requests of many calls arriving while it runs.

A round admits waiting requests to the free slots (one prefill per group of identical prompts), decodes up to
`sync_every` steps, reads the done flags back (the round's one host sync), queues half a round more for the live
slots so the GPU has work while the host harvests, then harvests the finished requests and frees their slots.
`compact_if_idle` moves the live slots down when no request waits, so a long tail decodes in a small batch.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Callable

import torch
from torch.profiler import record_function  # names the phases in a profile (bench/decode.py --longtail --profile)

from fleetrl import heartbeat
from fleetrl.engines.fast.graphs import bucket_for
from fleetrl.engines.fast.state import SlotBuffers, device_index


class SlotLoop:
    """One run's continuous-batching state over an engine's slot buffers. Requests are keyed by an id that also keys
    their random stream (`new_request`); `round` returns the ones that finished."""

    def __init__(self, engine: Any, buf: SlotBuffers, key: Any) -> None:
        self.e, self.buf, self.key = engine, buf, key
        self.free = list(range(buf.slots))
        self.buckets = [b for b in engine._buckets if b < buf.slots] + [buf.slots]
        self.running: dict[int, int] = {}  # slot -> request id
        self.length: dict[int, int] = {}  # slot -> prompt length
        self.sampled: dict[int, int] = {}  # slot -> tokens sampled (exact while live, capped at its limit)
        self.rows: dict[int, torch.Tensor] = {}  # request id -> prompt (until it finishes)
        self.limits: dict[int, int] = {}
        self.ahead = 0  # decode steps of the current round already queued, before the host's work at the last sync
        buf.done.fill_(True)

    def new_request(self, row: torch.Tensor, limit: int, key: int) -> int:
        """Registers a request -> its id: `key`, or the next free one above it (live requests must not share a
        random stream; with ids that are indices of one call they never clash)."""
        rid = key
        while rid in self.rows:
            rid = (rid + 1) & 0x7FFFFFFF
        self.rows[rid], self.limits[rid] = row, limit
        return rid

    def round(self, pending: deque[int], width: int | None = None,
              on_admit: Callable[[int], None] | None = None) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """Admits requests from `pending` to free slots (`on_admit(id)` each), decodes a round, reads the done flags
        -> the finished requests' (ids, token counts, tokens [n, width], log-probs [n, width]), their slots freed;
        `width` defaults to their largest limit."""
        e, buf = self.e, self.buf
        heartbeat.beat()
        admit = [(heapq.heappop(self.free), pending.popleft()) for _ in range(min(len(self.free), len(pending)))]
        if admit:
            with record_function("engine.prefill"):
                e._prefill(buf, self.rows, admit, self.limits, self.key)
            for slot, rid in admit:
                self.running[slot], self.length[slot], self.sampled[slot] = rid, len(self.rows[rid]), 1
                if on_admit is not None:
                    on_admit(rid)
        self._decode(e.sync_every - self.ahead)
        nb = bucket_for(max(self.running) + 1, self.buckets)
        # as Python lists: indexing the tensor per slot cost ~8 µs each, 2 ms per sync at 256 slots while the GPU
        # waited for the next step (profiled on an H200: 16 syncs, ~35 ms of a 0.41 s generate call)
        with record_function("engine.sync"):
            done, count = torch.stack((buf.done[:nb].long(), buf.count[:nb])).cpu().tolist()
        e.stats["syncs"] += 1
        finished = {s: self.running.pop(s) for s in list(self.running) if done[s]}
        # The host now harvests, compacts and prefills, ~10 ms of launches for a prefill at 0.5B, while the GPU
        # would idle after the sync drained it. So the live slots first decode half a round; that work queues
        # behind it, and admitted samples join for the other half (bench/RESULTS.md, "GPU speed, eighth round").
        # A finished slot's rows stay intact until then: it is done, and its followers read its prompt rows
        # until `release`, which queues after these steps too. In the tail (no prompt waits) these steps run
        # in the bucket from before the compaction: on CPU ~5% more rows computed; on the GPU the long-tailed
        # call got faster as a whole (bench/RESULTS.md, ninth round).
        self.ahead = self._decode(e.sync_every // 2) if finished and self.running else 0
        if not finished:
            return [], [], buf.out_tok[:0], buf.out_lp[:0]
        with record_function("engine.harvest"):
            index = device_index(list(finished), e.device)
            buf.release(index)  # before a prefill or a compaction reuses their rows
            rids = list(finished.values())
            width = width if width is not None else max(self.limits[r] for r in rids)
            toks, lps = buf.out_tok[index, :width], buf.out_lp[index, :width]
            for slot, rid in finished.items():
                heapq.heappush(self.free, slot)
                del self.length[slot], self.sampled[slot], self.rows[rid], self.limits[rid]
        return rids, [count[s] for s in finished], toks, lps

    def compact_if_idle(self, pending: deque[int]) -> None:
        if self.running and not pending:  # nothing to refill the freed slots with: shrink the decode batch instead
            with record_function("engine.compact"):
                self.e._compact(self.buf, self.running, self.length, self.sampled, self.free, self.buckets)

    def _decode(self, steps: int) -> int:
        return self.e._decode_round(steps, self.running, self.length, self.sampled, self.limits, self.buckets,
                                    self.key)
