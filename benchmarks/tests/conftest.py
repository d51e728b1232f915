"""The workbench's kernel tests run as tests/kernels' do: compiled on a CUDA GPU, in triton's CPU
interpreter where there is none (tests/kernels/conftest.py says how and why)."""

from tests.kernels.conftest import (  # noqa: F401 (pytest finds hooks and fixtures by name)
    device,
    interpreter_while_testing,
    pytest_collection_finish,
    pytest_collection_modifyitems,
)
