"""The engine's constrained requests: one grammar state each, advanced on every token it learns,
and the token bitmasks each step hands the runner.

Owns: compiling a request's constraint when it is added (`check`: a schema, regex or grammar that
does not compile is a ValueError and queues nothing), advancing its state on each generated token
(`accept`: a complete constraint finishes the request), and `attach`, which puts on a
`SchedulerOutput` the bitmask of every constrained token the step may sample: a prompt's first
token (`PrefillChunk.token_mask`), a slot that starts, and a slot whose request learned a token
since the last step (`SchedulerOutput.token_masks`). Must not: import torch, or decide when a row
may exit without its bitmask (the decode step holds such rows, `runner.token_masks`).

When bitmasks are computed: a slot's next bitmask is needed by the step after the one the host
learns its token in, and nothing else waits on the host meanwhile, so the masks of the requests
that learned tokens start on a worker thread as soon as the tokens are accepted (`prepare`) and
the engine builds that step's outputs and schedules the next while they run; `attach` collects
them. Masks for prompts and starting slots (rare) are computed in `attach` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future

from loopserve.engine.scheduler_output import SchedulerOutput, TokenMask
from loopserve.structured.grammar import GrammarCompiler, GrammarState, MaskWorker
from loopserve.structured_outputs import StructuredOutputsParams
from loopserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Constraints:
    """Grammar states by request id.

    Args:
        tokenizer: the model's tokenizer (None: constraints are refused, they are written in text).
        vocab_size: the model's vocabulary (logit rows).
        eos_token_ids: the ids that end a sequence (allowed once a constraint may end).
    """

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = frozenset(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._states: dict[str, GrammarState] = {}
        self._learned: set[str] = set()  # requests that accepted a token since the last attach
        self._worker: MaskWorker | None = None
        # The batch `prepare` started: its states (with the index each mask is for) and masks.
        self._pending: tuple[list[tuple[str, GrammarState, int]], Future[list[bytes]]] | None = None
        self._ready: dict[str, tuple[GrammarState, int, bytes]] = {}

    def check(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh state for `spec`; ValueError, saying why, when it cannot be served."""
        if self._tokenizer is None:
            raise ValueError(
                "structured_outputs needs the model's tokenizer (constraints are on text); this "
                "checkpoint has no tokenizer.json"
            )
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                self._tokenizer.to_json(), self._vocab_size, self._eos_token_ids
            )
        return self._compiler.state(spec)

    def add(self, request_id: str, state: GrammarState) -> None:
        self._states[request_id] = state

    def __len__(self) -> int:
        return len(self._states)

    def accept(self, request_id: str, token_ids: list[int]) -> str | None:
        """Advance a request past its new tokens. Returns the finish reason it now has: "stop"
        when its constraint is complete, "abort" when a token broke it (which a masked sample
        cannot do: logged as an error), None otherwise (and for unconstrained requests)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        self._settle()  # a state is never advanced while its mask is being computed
        try:
            for token in token_ids:
                state.accept(token)
        except ValueError as error:
            logger.error("request %r: %s; it is aborted", request_id, error)
            return "abort"
        self._learned.add(request_id)
        return "stop" if state.complete else None

    def drop(self, request_id: str) -> None:
        """Forget a finished request."""
        self._states.pop(request_id, None)
        self._learned.discard(request_id)
        self._ready.pop(request_id, None)

    def prepare(self) -> None:
        """Start computing the bitmasks of the requests that learned tokens (see the module
        docstring); `attach` uses them when their request is still at the same token."""
        self._settle()
        batch = [
            (request_id, state, state.num_accepted)
            for request_id in sorted(self._learned)
            if (state := self._states[request_id]).active
        ]
        if not batch:
            return
        if self._worker is None:
            assert self._compiler is not None  # a state exists, so a compiler made it
            self._worker = MaskWorker(self._compiler.mask_words)
        self._pending = batch, self._worker.submit([state for _, state, _ in batch])

    def _settle(self) -> None:
        """Wait for the batch in flight, if any, and keep its masks."""
        if self._pending is None:
            return
        batch, future = self._pending
        self._pending = None
        for (request_id, state, index), words in zip(batch, future.result(), strict=True):
            self._ready[request_id] = state, index, words

    def _mask(self, request_id: str, state: GrammarState) -> bytes | None:
        """The request's bitmask now: the prepared one when it is still current."""
        ready = self._ready.pop(request_id, None)
        if ready is not None and ready[0] is state and ready[1] == state.num_accepted:
            return ready[2]
        return state.mask()

    def attach(self, scheduled: SchedulerOutput) -> None:
        """The bitmasks the step needs, on `scheduled` (see the module docstring)."""
        self._settle()
        if not self._states:
            return
        for chunk in scheduled.prefill_chunks:
            state = self._states.get(chunk.request_id)
            if state is not None and chunk.completes_prompt:
                chunk.token_mask = state.mask()
        masks: list[TokenMask] = []
        started: set[int] = set()
        for start in scheduled.slot_starts:
            request_id = scheduled.decode_slots.get(start.slot)
            state = self._states.get(request_id) if request_id is not None else None
            if request_id is None or state is None:
                continue
            started.add(start.slot)
            begin_after = state.begin_after if state.begin_after is not None else -1
            words = self._mask(request_id, state)
            masks.append(TokenMask(start.slot, start.num_output_tokens, words, begin_after))
        slots = {request_id: slot for slot, request_id in scheduled.decode_slots.items()}
        for request_id in sorted(self._learned):
            slot = slots.get(request_id)
            state = self._states[request_id]
            if slot is None or slot in started:
                continue  # not decoding (preempted: its start will carry the bitmask) or started
            words = self._mask(request_id, state)
            if words is not None:
                begin_after = state.begin_after if state.begin_after is not None else -1
                masks.append(TokenMask(slot, state.num_accepted, words, begin_after))
        self._learned.clear()
        self._ready.clear()
        scheduled.token_masks = masks
