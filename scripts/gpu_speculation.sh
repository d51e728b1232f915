#!/usr/bin/env bash
# Self-speculative decoding on one GPU in one call (docs/speculation.md).
#   tests: tests/gpu/test_speculation_gpu.py (fp32 == reference, bf16 batch-invariant == plain,
#          graphs == eager, no synchronisation)
#   diffs: bf16 without batch_invariant, speculative against plain decoding on the random
#          Ouro-1.4B: requests and tokens that differ, and where the first difference is
#          and, at each request's first difference, whether it is a near tie: the top-2
#          log-prob margin there against the median margin over all plain tokens
#   bench: `bench offline` plain A B B A against speculative (scripts/gpu_ab.sh), on random
#          weights with the benchmark-only acceptance trace (SPEC's forced_acceptance)
#   timeline: one `bench offline --step-timeline` run plain and one speculative (BENCH_ARGS):
#          where a step's time goes, which decode step ran, graph captures (not in the default)
# Usage: OUT=$OUT [PARTS=tests,diffs,bench] [SPEC=json] [BENCH_ARGS=...] bash scripts/gpu_speculation.sh
# Writes: $OUT/tests.log, $OUT/diffs.json, gpu_ab.sh's files (ab-*.jsonl, ab.md, ab.log) and
#         $OUT/timeline-{plain,speculative}.jsonl with their -summary.md.
set -euo pipefail

OUT="${OUT:-$PWD/speculation-out}"
PARTS="${PARTS:-tests,diffs,bench}"
DEFAULT_SPEC='{"num_speculative_tokens":4,"draft_loops":2,"forced_acceptance":0.85}'
SPEC="${SPEC:-$DEFAULT_SPEC}"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

if [[ ",$PARTS," == *",tests,"* ]]; then
  "$PYTHON" -m pytest -q -m gpu tests/gpu/test_speculation_gpu.py tests/kernels/test_lanes_state.py \
    tests/kernels/test_decode_state.py -p no:cacheprovider \
    >"$OUT/tests.log" 2>&1 || echo "tests failed (rc $?)" | tee -a "$OUT/tests.log"
  tail -3 "$OUT/tests.log"
fi

if [[ ",$PARTS," == *",diffs,"* ]]; then
  "$PYTHON" - "$OUT/diffs.json" <<'PY'
import json, sys
from loopserve.bench.checkpoint_cache import ensure_random_checkpoint
from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.sampling_params import SamplingParams
import torch

model = str(ensure_random_checkpoint())
generator = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 49152, (int(n),), generator=generator).tolist()
           for n in torch.randint(16, 512, (32,), generator=generator)]
params = SamplingParams(
    max_tokens=64, temperature=0.0, ignore_eos=True, exit_threshold=0.6, logprobs=2
)


def margin(logprobs, index):
    """Top-1 minus top-2 log-prob of output `index` (nats): a near tie is close to 0."""
    top = logprobs[index].top
    return top[0][1] - top[1][1]


report = {}
for invariant in (True, False):
    outputs = {}
    # Speculating at every batch size (the default turns it off above 16 decoding requests).
    spec = {"num_speculative_tokens": 4, "draft_loops": 2, "disable_by_batch_size": None}
    for speculative in (None, spec):
        engine = Engine(EngineConfig.from_options(
            model=model, device="cuda", dtype="bfloat16", max_num_seqs=32,
            batch_invariant=invariant, speculative_config=speculative, num_kv_pages=8192))
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (
                        list(out.outputs[0].token_ids), list(out.outputs[0].exit_depths),
                        out.outputs[0].logprobs,
                    )
        outputs[speculative is not None] = [done[i] for i in ids]
        stats = engine.stats()
        del engine
        torch.cuda.empty_cache()
    plain, spec = outputs[False], outputs[True]
    differences = []  # (index, "token" or "depth", plain's margin, speculative's margin)
    for p, s in zip(plain, spec):
        index = next(
            (i for i, pair in enumerate(zip(zip(p[0], p[1]), zip(s[0], s[1]))) if pair[0] != pair[1]),
            None,
        )
        if index is not None:
            kind = "token" if p[0][index] != s[0][index] else "depth"
            differences.append((index, kind, margin(p[2], index), margin(s[2], index)))
    margins = sorted(margin(p[2], i) for p in plain for i in range(len(p[0])))
    report["batch_invariant" if invariant else "default"] = {
        "requests_differing": len(differences),
        "requests": len(plain),
        "first_difference_at": [d[0] for d in differences],
        "first_difference_kind": [d[1] for d in differences],
        "margin_at_first_difference_plain": [round(d[2], 5) for d in differences],
        "margin_at_first_difference_speculative": [round(d[3], 5) for d in differences],
        "median_margin_all_plain_tokens": round(margins[len(margins) // 2], 5),
        "proposed": stats.proposed_tokens, "confirmed": stats.confirmed_tokens,
    }
print(json.dumps(report, indent=1))
json.dump(report, open(sys.argv[1], "w"), indent=1)
PY
fi

if [[ ",$PARTS," == *",bench,"* ]]; then
  OUT="$OUT" A_ARGS="" B_ARGS="--speculative-config $SPEC" LABELS=plain,speculative \
    bash scripts/gpu_ab.sh
  cat "$OUT/ab.md"
fi

if [[ ",$PARTS," == *",timeline,"* ]]; then
  for side in plain speculative; do
    extra=""
    [[ $side == speculative ]] && extra="--speculative-config $SPEC"
    # shellcheck disable=SC2086  # BENCH_ARGS and extra are lists of flags
    "$PYTHON" -m loopserve.entrypoints.cli bench offline ${BENCH_ARGS:-} $extra --device cuda \
      --step-timeline "$OUT/timeline-$side.jsonl" --output "$OUT/timeline-$side-bench.jsonl" \
      >"$OUT/timeline-$side.log" 2>&1 || echo "timeline $side failed (rc $?)"
    tail -2 "$OUT/timeline-$side.log"
  done
fi
