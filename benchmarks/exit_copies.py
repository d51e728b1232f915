"""How much `full`-layout KV memory early exit fills with copies, and how much of it could be freed.

Owns: `python -m benchmarks.exit_copies`. In the `full` layout a token that exits after loop e
has its K/V copied into planes e .. max_loops - 1 (docs/looped-models.md §3). A page of plane p is a
*pure copy* of the page below it when every token on it exited at or before loop p: only then could
two planes share one page without changing any result. This counts, over the seeded exit traces of
the `trace` mode (the d2.6 distribution by default), the copy slots (positions whose version in a
plane is a copy) and the pure-copy pages among the pages of generated tokens. Must not: run a
model: trace depths depend only on (seed, token index), so the count is exact without one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from loopserve.depth.trace import D2_6, traced_depth


def count_copies(depths: Sequence[int], num_loops: int, block_size: int) -> dict[str, float]:
    """Copies among the pages of a run of generated tokens with these exit depths (page-aligned,
    every plane holding every position)."""
    planes = range(1, num_loops)  # plane 0 is always written by loop 1: never a copy
    copy_slots = sum(1 for depth in depths for plane in planes if depth <= plane)
    pages = [depths[start : start + block_size] for start in range(0, len(depths), block_size)]
    pure = sum(1 for page in pages for plane in planes if max(page) <= plane)
    total_pages = len(pages) * num_loops
    return {
        "tokens": len(depths),
        "pages": total_pages,
        "copy_slot_fraction": copy_slots / (len(depths) * num_loops),
        "pure_copy_pages": pure,
        "pure_copy_page_fraction": pure / total_pages,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--distribution", default=",".join(str(p) for p in D2_6))
    parser.add_argument("--tokens", type=int, default=128 * 1024, help="generated tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=64, help="requests the tokens are split over")
    args = parser.parse_args()
    distribution = tuple(float(p) for p in args.distribution.split(","))
    per_request = args.tokens // args.seeds
    depths = [
        traced_depth(seed, index, distribution)
        for seed in range(args.seeds)
        for index in range(per_request)
    ]
    record = count_copies(depths, len(distribution), args.block_size)
    print(json.dumps({"distribution": distribution, "block_size": args.block_size} | record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
