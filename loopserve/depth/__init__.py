"""How deep each token runs: the exit test, the exit modes, refill, and seeded exit traces.

Owns: the depth policy of a looped model (docs/looped-models.md §2 and §4). Must not: import
torch. Its functions take Python numbers or tensors and use only arithmetic, comparisons and tensor
methods, so the decode step (tensors on the device), the serial reference and the evaluators all
apply the same definition.
"""
