"""Triton kernels: of the attention backend, the layer ops and the decode step's bookkeeping.

Owns: the kernel modules below (KV write, paged decode with its per-row pieces and RoPE, packed
paged prefill; fused layer ops; the decode step's prologue and coda, `decode_state`, and its
copy-on-exit, `kv_copy`; the sampler's noise hash, `noise`) and `availability`, which says
whether triton is installed without importing it. Must not: import triton here; `import
loopserve.kernels` stays cheap and dependency-free, each kernel module imports triton itself and
is imported only by the code that uses it (a backend, the layer ops, a fused decode step, the
sampler on CUDA).

Under `TRITON_INTERPRET=1` (set before a kernel module is first imported) triton defines the
kernels for its CPU interpreter; that is how the kernels are tested without a GPU.
"""
