"""Continuous-batching scheduler: which sequences run in the next step, and their bookkeeping.

Each sample of a request is one `Sequence` in one KV-cache slot. Requests are admitted first come,
first served while slots are free (a request whose samples do not all fit takes the free slots and
the rest of its samples follow as slots free up: nothing is dropped). Samples of the same prompt share
its prefill: the first admitted sample (the *leader*) computes the prompt, the others copy the
keys/values of positions ``0 .. P - 2`` from a sibling's slot and compute only the last prompt token
themselves (one row each), which yields their first sampled token. Siblings are the ``n`` samples of one
request and the samples of other requests in flight with the same prompt tokens, the same adapter,
the same weight version at submission and the same routed-experts flag (a `PrefixGroup`): a client
that sends ``n`` single-sample requests per prompt (SGLang's API does) computes each prompt once.

Every step runs one decode token for each sequence past its prompt, plus up to ``prefill_chunk``
prompt tokens. The scheduler holds no tensors; the engine runs the forward, appends the sampled
tokens and calls `Scheduler.finish` / `Scheduler.record_routing`. It is only used under the engine's
step lock.
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tandem.core.protocols import (
    Completion,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from tandem.engines.inference.common import error_result
from tandem.engines.inference.torch.kv_cache import PrefillChunk
from tandem.engines.inference.torch.sampling import RowSampler

__all__ = ["Phase", "PrefixGroup", "RequestState", "Scheduler", "Sequence", "StepPlan"]


class Phase(enum.Enum):
    WAIT_PREFIX = "wait_prefix"  # a sibling is computing the shared prompt prefix
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False, slots=True)
class Sequence:
    request: RequestState
    index: int  # sample index within the request
    slot: int
    sampler: RowSampler
    num_cached: int = 0  # tokens whose keys/values are in the slot
    phase: Phase = Phase.PREFILL
    output: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)  # own rows from position P - 1 on
    finish_reason: FinishReason | None = None
    spec_k: int = 0  # speculative decoding: draft tokens of the next verification (0: the configured k)
    spec_hidden: list = field(default_factory=list)  # draft head: (hidden rows, tokens) it produced
    spec_last: object = None  # draft head: the hidden row that produced the newest token
    spec_q: object = None  # the draft's sampling distributions [k, V] (None: point masses)

    @property
    def length(self) -> int:
        return len(self.request.prompt) + len(self.output)

    def token_at(self, pos: int) -> int:
        prompt = self.request.prompt
        return prompt[pos] if pos < len(prompt) else self.output[pos - len(prompt)]


@dataclass(eq=False, slots=True)
class PrefixGroup:
    """Requests in flight that may share one prompt prefill (same key: prompt, adapter, version, routing)."""

    key: tuple
    prefix_len: int  # positions 0 .. P - 2 are shared; each sample computes position P - 1 itself
    requests: list[RequestState] = field(default_factory=list)
    prompt_routing: list[np.ndarray] = field(default_factory=list)  # rows of positions 0 .. P - 2
    routed_rows: int = 0

    def live(self) -> Iterator[Sequence]:
        for state in self.requests:
            for seq in state.sequences:
                if seq.phase is not Phase.DONE:
                    yield seq

    def prefix_source(self) -> Sequence | None:
        """A live sibling whose slot holds the keys/values of the shared prefix."""
        for seq in self.live():
            if seq.phase is not Phase.WAIT_PREFIX and seq.num_cached >= self.prefix_len:
                return seq
        return None


@dataclass(eq=False, slots=True)
class RequestState:
    request: GenerationRequest
    prompt: list[int]  # validated prompt token ids
    params: SamplingParams  # validated
    future: concurrent.futures.Future
    seeds: list[int]  # one generator seed per sample
    pending: deque[int] = field(default_factory=deque)  # sample indices not admitted yet
    sequences: list[Sequence] = field(default_factory=list)
    completions: dict[int, Completion] = field(default_factory=dict)
    group: PrefixGroup | None = None  # set by `Scheduler.add`

    @property
    def prefix_len(self) -> int:
        return len(self.prompt) - 1


@dataclass(slots=True)
class StepPlan:
    decode: list[Sequence]  # ascending slot
    prefill: list[tuple[Sequence, PrefillChunk]]
    copies: list[tuple[int, int, int]]  # (src_slot, dst_slot, length) to run before the forward
    # speculative decoding (the engine moves drafted sequences here from ``decode``): each verifies its
    # draft as a chunk of its last token + the draft
    verify: list[tuple[Sequence, PrefillChunk, list[int]]] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        return self.decode + [s for s, _ in self.prefill] + [s for s, _, _ in self.verify]


class Scheduler:
    """Slot allocation, admission and step planning for the engine."""

    def __init__(self, num_slots: int, prefill_chunk: int) -> None:
        self.free_slots = list(range(num_slots))  # kept sorted: lowest first keeps decode slots dense
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[RequestState] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.active: dict[str, RequestState] = {}  # request id -> state, until resolved
        self.groups: dict[tuple, PrefixGroup] = {}  # prefix-sharing key -> requests in flight

    @property
    def num_waiting(self) -> int:
        return sum(len(r.pending) for r in self.waiting)

    def add(self, state: RequestState, share: tuple = ()) -> None:
        """Queue a request. ``share``: what else must match (beyond the prompt and the routed-experts
        flag) for another request's keys/values to serve as this one's prefix (the engine passes the
        adapter and the weight version)."""
        state.pending.extend(range(state.params.n))
        self.waiting.append(state)
        self.active[state.request.request_id] = state
        key = (tuple(state.prompt), bool(state.params.return_routed_experts), *share)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = PrefixGroup(key=key, prefix_len=state.prefix_len)
        group.requests.append(state)
        state.group = group

    def _leave_group(self, state: RequestState) -> None:
        group = state.group
        if group is None:
            return
        if state in group.requests:
            group.requests.remove(state)
        if not group.requests and self.groups.get(group.key) is group:
            del self.groups[group.key]

    def admit(self, make_sampler) -> None:
        """Give free slots to waiting samples, first come first served."""
        while self.waiting and self.free_slots:
            state = self.waiting[0]
            while state.pending and self.free_slots:
                index = state.pending.popleft()
                slot = self.free_slots.pop(0)
                seq = Sequence(request=state, index=index, slot=slot, sampler=make_sampler(state, index))
                sibling_alive = next(state.group.live(), None) is not None
                seq.phase = Phase.WAIT_PREFIX if sibling_alive and state.prefix_len > 0 else Phase.PREFILL
                state.sequences.append(seq)
                self.running[slot] = seq
            if not state.pending:
                self.waiting.popleft()

    def plan(self) -> StepPlan:
        copies = self._start_followers()
        decode = sorted((s for s in self.running.values() if s.phase is Phase.DECODE), key=lambda s: s.slot)
        budget = self.prefill_chunk
        prefill = []
        for seq in sorted(self.running.values(), key=lambda s: s.slot):
            if seq.phase is not Phase.PREFILL or budget <= 0:
                continue
            count = min(budget, len(seq.request.prompt) - seq.num_cached)
            prefill.append((seq, PrefillChunk(slot=seq.slot, start=seq.num_cached, count=count)))
            budget -= count
        return StepPlan(decode=decode, prefill=prefill, copies=copies)

    def _start_followers(self) -> list[tuple[int, int, int]]:
        """Followers whose prefix is ready copy it; orphaned followers (leader gone) prefill alone."""
        copies = []
        for seq in list(self.running.values()):
            if seq.phase is not Phase.WAIT_PREFIX:
                continue
            group = seq.request.group
            source = group.prefix_source()
            if source is not None:
                copies.append((source.slot, seq.slot, group.prefix_len))
                seq.num_cached, seq.phase = group.prefix_len, Phase.PREFILL
            elif not any(s.phase is Phase.PREFILL for s in group.live()):
                seq.phase = Phase.PREFILL  # no sibling computes the prefix any more: compute it here
        return copies

    def free(self, seq: Sequence) -> None:
        if self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.free_slots.append(seq.slot)
            self.free_slots.sort()

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence: free its slot and store its completion; resolve the request when complete."""
        seq.phase, seq.finish_reason = Phase.DONE, reason
        self.free(seq)
        state = seq.request
        state.completions[seq.index] = Completion(
            token_ids=list(seq.output),
            log_probs=list(seq.log_probs),
            finish_reason=reason,
            weight_versions=list(seq.versions),
            routed_experts=self._routed(seq) if state.params.return_routed_experts else None,
        )
        if len(state.completions) == state.params.n:
            self._resolve(state)

    def abort(self, request_id: str | None) -> None:
        """Abort one request (``None``: all): partial responses, finish reason ABORT."""
        states = list(self.active.values()) if request_id is None else [self.active.get(request_id)]
        for state in states:
            if state is None:
                continue
            for index in list(state.pending):
                state.completions[index] = Completion(
                    token_ids=[], log_probs=[], finish_reason=FinishReason.ABORT
                )
            state.pending.clear()
            if state in self.waiting:
                self.waiting.remove(state)
            for seq in state.sequences:
                if seq.phase is not Phase.DONE:
                    self.finish(seq, FinishReason.ABORT)
            if len(state.completions) == state.params.n:
                self._resolve(state)

    def fail(self, state: RequestState, message: str) -> None:
        """Fail a whole request (e.g. its step raised): one ERROR completion, slots freed."""
        for seq in state.sequences:
            seq.phase = Phase.DONE
            self.free(seq)
        state.pending.clear()
        if state in self.waiting:
            self.waiting.remove(state)
        self.active.pop(state.request.request_id, None)
        self._leave_group(state)
        if not state.future.done():
            state.future.set_result(error_result(state.request, message))

    def _resolve(self, state: RequestState) -> None:
        self.active.pop(state.request.request_id, None)
        self._leave_group(state)
        if not state.future.done():
            completions = [state.completions[i] for i in range(state.params.n)]
            state.future.set_result(
                GenerationResult(
                    request_id=state.request.request_id,
                    prompt_token_ids=list(state.prompt),
                    completions=completions,
                )
            )

    def record_routing(self, seq: Sequence, start: int, rows: np.ndarray) -> None:
        """Routing rows ``[count, layers, topk]`` of positions ``start ..`` computed for ``seq``."""
        group = seq.request.group
        shared = max(0, min(group.prefix_len, start + len(rows)) - max(start, group.routed_rows))
        if shared:
            offset = max(start, group.routed_rows) - start
            group.prompt_routing.append(rows[offset : offset + shared])
            group.routed_rows += shared
        own = rows[max(0, group.prefix_len - start) :]
        if len(own):
            seq.routing.append(own)

    def _routed(self, seq: Sequence) -> np.ndarray | None:
        rows = seq.request.group.prompt_routing + seq.routing
        if not rows:
            return None
        expected = len(seq.request.prompt) + len(seq.output) - 1
        out = np.concatenate(rows)[:expected]
        return np.ascontiguousarray(out, dtype=np.int32)
