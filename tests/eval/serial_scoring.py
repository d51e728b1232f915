"""An obviously serial teacher-forced scorer: one position at a time, one loop at a time.

Test helper only. It keeps every (position, loop, layer) K/V and reads position j at loop d
through version min(d, e_j) (docs/looped-models.md §3, `full` layout), so it shares no code with the
dense scorer except the model and the exit rule.
"""

from __future__ import annotations

import math

import torch

from loopserve.depth.exit_test import next_survival, threshold_reached
from loopserve.eval.early_exit_perplexity import ExitSettings
from loopserve.models.layers import LoopContext
from loopserve.models.ouro import OuroForCausalLM


def _single_query_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """q [Nq, D], keys/values [J, Nkv, D] -> [Nq, D]."""
    groups = q.shape[0] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)  # [J, Nq, D]
    values = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("hd,jhd->hj", q, keys) / math.sqrt(q.shape[-1])  # [Nq, J]
    return torch.einsum("hj,jhd->hd", scores.softmax(-1), values)


@torch.no_grad()
def serial_score(
    model: OuroForCausalLM, tokens: list[int], settings: ExitSettings
) -> tuple[list[float], list[int]]:
    """Log-probabilities of tokens[1:] and the exit depth of each predicting position."""
    cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    exit_depth: dict[int, int] = {}
    logprobs: list[float] = []
    for position in range(len(tokens) - 1):
        hidden = model.embed(torch.tensor([tokens[position]]))
        cos, sin = model.rope(torch.tensor([position]))
        survival = torch.ones(1)
        for loop in range(1, settings.max_loops + 1):

            def attend(
                layer: int,
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                position: int = position,
                loop: int = loop,
            ) -> torch.Tensor:
                cache[(position, loop, layer)] = (k[0], v[0])
                versions = [(j, min(loop, exit_depth[j])) for j in range(position)]
                seen = [cache[(j, version, layer)] for j, version in versions] + [(k[0], v[0])]
                keys = torch.stack([key for key, _ in seen])
                values = torch.stack([value for _, value in seen])
                return _single_query_attention(q[0], keys, values)[None]

            previous = hidden
            hidden = model.run_loop(hidden, LoopContext(cos=cos, sin=sin, attention=attend))
            done = loop == settings.max_loops
            if settings.exit_threshold < 1.0 and not done:
                hazard = model.exit_probability(hidden, previous, settings.exit_threshold)
                survival = next_survival(survival, hazard)
                reached = threshold_reached(
                    survival, loop, settings.min_loops, settings.exit_threshold
                )
                done = position > 0 and bool(reached.item())
            if done:
                log_softmax = torch.log_softmax(model.compute_logits(hidden)[0], dim=-1)
                logprobs.append(log_softmax[tokens[position + 1]].item())
                exit_depth[position] = loop
                break
    return logprobs, [exit_depth[position] for position in range(len(tokens) - 1)]
