"""The paged KV cache as every layer sees it: page arithmetic, the KV layouts, device storage and
attention metadata.

Owns: what the scheduler, the runner, the attention backends and the kernels must agree on about
KV pages. Must not: import anything else of loopserve. `pages` and `layout` are torch-free (the
scheduler uses them); `storage` and `metadata` hold device tensors.
"""
