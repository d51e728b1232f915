"""Triton kernels of the attention backend.

Owns: the kernel modules below (KV write, paged decode, packed paged prefill). Must not: import
triton here; `import loopserve.kernels` stays cheap and dependency-free, each kernel module imports
triton itself and is imported only by the backend that uses it.

Under `TRITON_INTERPRET=1` (set before a kernel module is first imported) triton defines the
kernels for its CPU interpreter; that is how the kernels are tested without a GPU.
"""
