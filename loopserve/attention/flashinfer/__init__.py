"""FlashInfer attention backends (`flashinfer_fa2`, `flashinfer_xqa`), optional behind the
`flashinfer` extra.

Owns: nothing at package level. Must not: import flashinfer here or in any module's top level;
every module of this package imports it inside the methods that launch kernels, so the registry
and the CPU test suite never need it. See docs/kernels.md ("FlashInfer backends").
"""
