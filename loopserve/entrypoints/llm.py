"""`LLM`: the offline Python API (a thin wrapper around `Engine`, not a subclass of it).

Owns: turning a batch of prompts into ordered outputs, with a progress bar for large batches.
Must not: duplicate engine logic; everything goes through `Engine.add_request` and `Engine.step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """Generate with a looped model.

    Args:
        model: checkpoint directory (HF layout); None uses the built-in tiny model.
        **engine_options: any setting of `EngineConfig` or its `SchedulerConfig` (device, dtype,
            kv_layout, attention_backend, exit_mode, scheduling, max_num_seqs, seed, ...).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig.from_options(model=model, **engine_options))

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default SamplingParams()).
            use_tqdm: show a progress bar; None shows one for more than 8 prompts.
        Returns:
            One finished RequestOutput per prompt.
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        ids: list[str] = []
        try:
            for prompt, request_params in zip(batch, params, strict=True):
                ids.append(self.engine.add_request(prompt, request_params))
        except ValueError as error:
            for request_id in ids:  # bad input loses nothing: undo what was queued
                self.engine.abort(request_id)
            raise ValueError(f"prompt {len(ids)}: {error}") from None
        show = len(batch) > 8 if use_tqdm is None else use_tqdm
        return self._run(ids, show)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="generating", unit="req", dynamic_ncols=True)
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    generated += len(output.new_token_ids)
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                if progress is not None:
                    rate = generated / max(progress.format_dict["elapsed"], 1e-9)
                    progress.set_postfix(tok_per_s=f"{rate:.1f}", refresh=False)
        except BaseException:
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in ids]


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(item, int) for item in value)
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and _is_token_ids(prompts):
        return [[int(token) for token in prompts]]  # type: ignore[arg-type]
    batch: list[Prompt] = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) and not _is_token_ids(prompt):
            raise TypeError(f"prompt {index} must be a string or a list of token ids")
        batch.append(prompt)  # type: ignore[arg-type]
    return batch


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
