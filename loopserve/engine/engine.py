"""The engine: requests in, one step at a time, `RequestOutput`s out.

Owns: request validation at the boundary, resolving per-request defaults (`ResolvedParams`; the
checkpoint's end-of-sequence set, `engine.end_of_sequence`; its generation_config.json sampling
defaults for requests that give no params), the schedule -> execute -> update loop,
detokenization, stop strings and constraints (`engine.constraints`: the grammar states of
requests with structured outputs, whose bitmasks each step carries to the runner), and statistics.
Must not: touch device tensors (the runner does), make batching decisions (the scheduler does),
or import the runner: it drives whatever `Runner` it is handed (`engine.runner_api`).

Lifecycle of a request: `add_request` validates and queues it -> `step` admits it when a slot and
its KV reservation are free -> prompt chunks run through every loop -> the first token is sampled
-> each later token runs loop by loop until it exits -> it finishes (stop, length or `abort`) and
frees its slot and pages.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

from loopserve.config import EngineConfig
from loopserve.depth.policy import ExitMode
from loopserve.depth.trace import resolve_distribution
from loopserve.engine.constraints import Constraints
from loopserve.engine.detokenizer import IncrementalDetokenizer
from loopserve.engine.end_of_sequence import end_of_sequence
from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.runner_api import PendingStep, Runner, RunnerInfo, default_runner
from loopserve.engine.sampling_defaults import checked_sampling_defaults
from loopserve.engine.scheduler import Scheduler
from loopserve.engine.scheduler_output import SchedulerOutput
from loopserve.engine.stats import EngineStats
from loopserve.models.generation_config import GenerationDefaults, read_generation_defaults
from loopserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loopserve.request import Request
from loopserve.sampling_params import ResolvedParams, SamplingParams
from loopserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Engine:
    """Drives a `Runner` one step at a time.

    Args:
        config: the engine's settings.
        runner: what executes the steps; None builds the default runner for `config` (the
            checkpoint on `config.device`). Tests and profilers pass their own.
    """

    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        self.config = config
        self.runner = runner if runner is not None else default_runner(config)
        self.info: RunnerInfo = self.runner.info
        self.model_config = self.info.model_config
        scheduler_config = config.scheduler
        if scheduler_config.exit_mode is ExitMode.TRACE:  # a runner handed in was not checked
            resolve_distribution(
                scheduler_config.trace_distribution,
                self.model_config.family,
                self.model_config.num_loops,
            )
        speculative = scheduler_config.speculative_config
        if speculative is not None:  # a runner handed in was not checked
            speculative.check_model(
                self.model_config.num_loops,
                self.model_config.family,
                self.model_config.num_stage_layers,
            )
        model_dir = Path(self.info.model_dir) if self.info.model_dir is not None else None
        self.tokenizer = Tokenizer.from_directory(model_dir) if model_dir is not None else None
        generation = (
            read_generation_defaults(model_dir) if model_dir is not None else GenerationDefaults()
        )
        self.end_of_sequence = end_of_sequence(self.model_config, generation, self.tokenizer)
        self.eos_token_ids = self.end_of_sequence.token_ids
        logger.info("end-of-sequence ids: %s", self.end_of_sequence.describe())
        self.sampling_defaults = checked_sampling_defaults(
            generation, use=config.generation_config != "none"
        )
        self._default_params = SamplingParams(**self.sampling_defaults.overrides())
        self.kv = KVCacheManager(
            self.info.num_kv_pages,
            scheduler_config.block_size,
            scheduler_config.prefix_caching,
            last_plane_differs=self.model_config.num_stage_layers > 0,
        )
        self.scheduler = Scheduler(
            scheduler_config,
            self.kv,
            self.model_config.num_loops,
            pinned_swap_pages=self.info.pinned_swap_pages,
            replays=self.model_config.num_stage_layers == 0,
        )
        self.constraints = Constraints(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Async scheduling: the step launched last, not yet read back.
        self._async = config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # Whether the last step had to read the step in flight back before scheduling
        # (`Scheduler.needs_sync`); read by observers such as the benchmark's step timeline.
        self.last_step_synced = False

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        """What a request that gives no `SamplingParams` runs with: `SamplingParams()` with the
        checkpoint's generation_config.json sampling fields (unless `generation_config="none"`)."""
        return self._default_params

    # ----- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input.

        `params` None runs with `default_sampling_params()`."""
        params = params or self._default_params
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:  # never collide with an id a caller chose
                request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError(
                f"an engine request runs one sequence, got n={params.n}: add n requests (seed + i "
                "for sequence i, as LLM.generate does) or use LLM.generate"
            )
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = self._prompt_ids(prompt)
        resolved = self.resolve(params)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the maximum model length {self.max_model_len}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)"
            )
        stop_ids = resolved.eos_token_ids | set(params.stop_token_ids)
        if len(stop_ids) > self.info.max_stop_token_ids:
            raise ValueError(
                f"at most {self.info.max_stop_token_ids} end-of-sequence plus stop token ids per "
                f"request, got {len(stop_ids)}"
            )
        grammar = None
        if params.structured_outputs is not None and self.config.scheduler.speculative_config:
            raise ValueError(
                "structured outputs are not served with speculative_config yet: run this "
                "request on an engine without speculation"
            )
        if params.structured_outputs is not None:
            grammar = self.constraints.check(params.structured_outputs)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=resolved,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            prompt=text,
            priority=params.priority,
        )
        self.scheduler.add(request)
        self._requests[request_id] = request
        if grammar is not None:
            self.constraints.add(request_id, grammar)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop
            )
        return request_id

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(token) for token in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [token for token in ids if not 0 <= token < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def resolve(self, params: SamplingParams) -> ResolvedParams:
        """Fill in the engine's defaults for one request."""
        loops = self.model_config.num_loops
        max_loops = params.max_loops if params.max_loops is not None else loops
        if max_loops > loops:
            raise ValueError(f"max_loops {max_loops} exceeds the model's loop count ({loops})")
        if params.min_loops > max_loops:
            raise ValueError(f"min_loops {params.min_loops} exceeds max_loops {max_loops}")
        beyond = [depth for depth in params.trace_depths or () if not 1 <= depth <= loops]
        if beyond:
            raise ValueError(
                f"trace_depths must each be in 1..{loops} (the model's loop count), got "
                f"{beyond[:5]}"
            )
        threshold = params.exit_threshold
        if threshold is None:
            threshold = self.model_config.early_exit_threshold
        if threshold < 1.0 and not self.model_config.has_exit_rule:
            raise ValueError(
                f"exit_threshold {threshold} asks for adaptive exits, but "
                f"{self.model_config.family} models have no exit rule (no gate, no convergence "
                "test): leave it unset (every token runs max_loops loops) or use exit_mode "
                "'trace'"
            )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return ResolvedParams(
            params=params,
            seed=seed,
            min_loops=params.min_loops,
            max_loops=max_loops,
            exit_threshold=threshold,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block, so later prompts are computed anew (benchmarks
        between runs that must not share prefills; vLLM's `reset_prefix_cache`). Running
        requests keep their pages."""
        self.kv.reset_prefix_cache()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free what it holds; returns its final output (None if unknown)."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        request.metrics.finished_time = time.monotonic()
        return self._output(request, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    # ----- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that changed.

        With async scheduling, a pure decode step is launched before the previous one is read
        back, so its outputs arrive with the next call; steps with prompt work are synchronous.
        """
        outputs: list[RequestOutput] = []
        self.last_step_synced = self._in_flight is not None and self.scheduler.needs_sync()
        if self.last_step_synced:
            outputs += self._read_back()
        scheduled = self.scheduler.schedule()
        self.constraints.attach(scheduled)
        if scheduled.is_empty:
            return outputs + (self._read_back() if self._in_flight is not None else [])
        now = time.monotonic()
        for chunk in scheduled.prefill_chunks:
            metrics = self._requests[chunk.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        pending = self.runner.execute(scheduled)
        previous, self._in_flight = self._in_flight, (scheduled, pending)
        if previous is not None:
            outputs += self._complete(*previous)
        if scheduled.prefill_chunks or not self._async:
            outputs += self._read_back()
        return outputs

    def _read_back(self) -> list[RequestOutput]:
        assert self._in_flight is not None
        scheduled, pending = self._in_flight
        self._in_flight = None
        return self._complete(scheduled, pending)

    def _complete(self, scheduled: SchedulerOutput, pending: PendingStep) -> list[RequestOutput]:
        changed = self.scheduler.update(scheduled, pending.result())
        verdicts = [
            self.constraints.accept(request.request_id, request.output_token_ids[-count:])
            for request, count in changed
        ]
        self.constraints.prepare()  # the next bitmasks, computed while the outputs are built
        now = time.monotonic()
        return [
            self._after_tokens(request, count, now, verdict)
            for (request, count), verdict in zip(changed, verdicts, strict=True)
        ]

    def _after_tokens(
        self, request: Request, count: int, now: float, verdict: str | None
    ) -> RequestOutput:
        """`count` new tokens (several only where requests speculate); `verdict`: what the
        request's constraint says of them (`Constraints.accept`)."""

        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        new_ids = request.output_token_ids[-count:]
        new_text = ""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is not None:
            first = request.num_output_tokens - count
            for index, token in enumerate(new_ids):
                text, stop = detokenizer.add([token])
                new_text += text
                if stop is not None and (index < count - 1 or not request.finished):
                    self.scheduler.stop_at(request, first + index + 1, stop)
                    new_ids = new_ids[: index + 1]
                    break
        metrics.token_times.extend([now] * len(new_ids))
        if verdict is not None and not request.finished:
            self.scheduler.finish(request, verdict)  # complete ("stop") or broken ("abort")
        if request.finished:
            metrics.finished_time = now
        return self._output(request, new_ids, new_text)

    def _output(self, request: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        detokenizer = self._detokenizers.get(request.request_id)
        if request.finished:
            self._requests.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
            self.constraints.drop(request.request_id)
            if detokenizer is not None:
                new_text += detokenizer.flush()  # text held back for a stop string that never came
        completion = CompletionOutput(
            index=0,
            text=detokenizer.text if detokenizer is not None else "",
            token_ids=list(request.output_token_ids),
            exit_depths=list(request.exit_depths),
            logprobs=list(request.logprobs) if request.params.params.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            new_token_ids=new_ids,
            new_text=new_text,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.finished,
            metrics=request.metrics,
        )

    def stats(self) -> EngineStats:
        scheduler = self.scheduler.stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_total=self.kv.num_usable_pages,
            kv_pages_used=self.kv.num_used_pages,
            kv_pages_free=self.kv.num_free_pages,
            steps=scheduler.steps,
            decode_steps=scheduler.decode_steps,
            mean_rows_per_decode_step=scheduler.mean_rows_per_decode_step,
            row_loops_by_loop=dict(sorted(scheduler.row_loops.items())),
            rows_per_step=dict(sorted(scheduler.rows_per_step.items())),
            prefill_tokens=scheduler.prefill_tokens,
            generated_tokens=scheduler.generated_tokens,
            kv_pages_cached=self.kv.num_cached_pages,
            num_preemptions=scheduler.preemptions,
            recomputed_tokens=scheduler.recomputed_tokens,
            prefix_cache_hit_rate=scheduler.prefix_hit_rate,
            prefix_hit_tokens=scheduler.prefix_hit_tokens,
            prefix_query_tokens=scheduler.prefix_query_tokens,
            proposed_tokens=scheduler.proposed_tokens,
            confirmed_tokens=scheduler.confirmed_tokens,
            speculative_tokens=scheduler.speculative_tokens,
            speculating=self.scheduler.speculating,
            speculation_switches=scheduler.speculation_switches,
        )
