"""A prompt pass's slot mapping: each token's slot in the pass's plane, and the null page for the
tokens the pass keeps (replayed tokens past their exit loop, `PromptPass.kept`), in the eager
metadata and in the padded metadata a prompt CUDA graph reads."""

from __future__ import annotations

import torch

from loopserve.kv.pages import NULL_PAGE
from loopserve.runner.block_tables import BlockTables, PromptPass

BLOCK = 4


def tables() -> BlockTables:
    tables = BlockTables(
        max_num_seqs=3, num_planes=2, max_pages=4, block_size=BLOCK, device=torch.device("cpu")
    )
    # slot 1, plane 1: pages 9, 5, 7; slot 2, plane 1: pages 3, 8
    tables.tables[1, 1, :3] = torch.tensor([9, 5, 7], dtype=torch.int32)
    tables.tables[2, 1, :2] = torch.tensor([3, 8], dtype=torch.int32)
    return tables


def prompt_pass(kept: list[int] | None) -> PromptPass:
    # Slot 1's positions 3..6 and slot 2's positions 0..1, in plane 1.
    return PromptPass(
        slots=torch.tensor([1, 2]),
        plane=1,
        positions=torch.tensor([3, 4, 5, 6, 0, 1]),
        sequence_of_token=torch.tensor([0, 0, 0, 0, 1, 1]),
        query_start=[0, 4, 6],
        seq_lens=[7, 2],
        kept=None if kept is None else torch.tensor(kept),
    )


def expected(kept: list[int]) -> list[int]:
    slots = [9 * BLOCK + 3, 5 * BLOCK + 0, 5 * BLOCK + 1, 5 * BLOCK + 2, 3 * BLOCK, 3 * BLOCK + 1]
    return [NULL_PAGE * BLOCK if index in kept else slot for index, slot in enumerate(slots)]


def test_kept_tokens_write_into_the_null_page() -> None:
    block_tables = tables()
    assert block_tables.prefill_metadata(prompt_pass(None)).slot_mapping.tolist() == expected([])
    got = block_tables.prefill_metadata(prompt_pass([1, 2, 5])).slot_mapping
    assert got.tolist() == expected([1, 2, 5])


def test_padded_metadata_keeps_the_same_tokens() -> None:
    block_tables = tables()
    static = block_tables.static_prefill_metadata(max_sequences=3, max_tokens=8)
    padded = block_tables.padded_prefill_metadata(prompt_pass([0, 4]), static)
    assert padded.slot_mapping.tolist() == expected([0, 4]) + [NULL_PAGE * BLOCK] * 2


def test_position_slots_follow_one_request_s_plane() -> None:
    got = tables().position_slots(1, 1, torch.tensor([0, 5, 9]))
    assert got.tolist() == [9 * BLOCK, 5 * BLOCK + 1, 7 * BLOCK + 1]
