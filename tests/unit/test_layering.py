"""Imports run one way. Each part of the package may import only the parts listed for it here, so
the layering cannot quietly rot; and the engine core runs without torch or the runner when it is
handed a runner."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import loopserve

PACKAGE = Path(loopserve.__file__).parent
# Torch-free value types every layer may use.
CORE = {"config", "sampling_params", "structured_outputs", "outputs", "request", "tokenizer"} | {
    "speculative_config"
}
# Part -> the parts it may import besides itself. A part or an entry is a package ("engine") or a
# module ("engine.scheduler_output"); `*` allows everything.
ALLOWED: dict[str, set[str]] = {
    "entrypoints": {"*"},
    # Engine replicas on Ray Serve: the server's code behind an ingress; before Ray starts, the
    # checks of the engine's settings an engine runs before its weights load (runner.setup).
    "ray": {"entrypoints.openai", "engine.engine", "engine.stats", "engine.prefix_cache"}
    | {"models.builtin", "runner.setup"}
    | CORE,
    # the user-facing benchmarks drive the engine; kernel instruments live in benchmarks/
    "bench": {"engine", "runner", "models", "depth"} | CORE,
    # the evaluator keeps K/V as an fp8 cache stores them (kv.storage's rounding rule)
    "eval": {"models", "depth", "data", "kv.storage"} | CORE,
    "train": {"models", "data"} | CORE,
    "data": set(),
    # the reference keeps K/V as the cache stores them (kv.storage's fp8 rounding rule)
    "reference": {"models", "sample", "depth", "structured", "kv.storage"} | CORE,
    "reference_spec": {"models.model_config", "models.huginn_config", "reference"},
    "engine": {"depth", "kv.pages", "kv.layout", "models.model_config", "models.generation_config"}
    | {"structured"}
    | CORE,
    "runner": {"engine.scheduler_output", "engine.runner_api", "models", "attention", "sample"}
    | {"kernels", "kv", "depth"}
    | CORE,
    # Huginn's random initial state is drawn from the counter-based noise that sampling uses
    # fp8 weights round by the fp8 KV cache's rule (kv.storage.to_cache_dtype)
    "models": {"kernels", "sample.noise", "kv.storage"},
    "attention": {"kernels", "kv"},
    # the decode-state kernels return the depth rule's own outcome type
    "kernels": {"kv", "depth.policy"},
    # small host values reach the device one way; the noise hash and token choice have Triton twins
    "sample": {"sampling_params", "kv.transfer", "kernels.availability"}
    | {"kernels.noise", "kernels.sampling"},
    "kv": set(),
    "depth": {"sampling_params", "kv"},
    "config": {"depth", "kv", "speculative_config"},
    "speculative_config": set(),
    "request": {"outputs", "sampling_params"},
    "sampling_params": {"structured_outputs"},
    "structured_outputs": set(),
    # grammars of structured outputs (llguidance): torch-free, so the engine may hold their state
    "structured": {"structured_outputs"},
    "outputs": set(),
    "tokenizer": set(),
    "__init__": {"*"},  # the public facade: it re-exports lazily (`import loopserve` stays light)
}


def _part(module: str) -> str:
    """`loopserve.engine.scheduler` -> `engine`; `loopserve.config` -> `config`."""
    return module.split(".")[1]


def _covers(entry: str, target: str) -> bool:
    """Whether an ALLOWED entry admits the dotted target (without the `loopserve.` prefix)."""
    return entry == "*" or target == entry or target.startswith(entry + ".")


def _imports(path: Path) -> list[str]:
    """Every `loopserve.*` module a file imports, at module level or inside functions."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "loopserve":  # `from loopserve import X`: the root re-exports
                found += [
                    f"loopserve.{alias.name}" for alias in node.names if alias.name != "__version__"
                ]
            else:
                found.append(node.module)
    return [name for name in found if name.startswith("loopserve.")]


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts)


def test_every_import_runs_in_an_allowed_direction() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        part = "__init__" if name == "loopserve.__init__" else _part(name)
        allowed = ALLOWED[part]
        for target in _imports(path):
            if _part(target) == part:
                continue
            dotted = target.removeprefix("loopserve.")
            if not any(_covers(entry, dotted) for entry in allowed):
                violations.append(f"{name} imports {target}")
    assert not violations, "\n".join(violations)


def test_the_check_catches_a_wrong_direction(tmp_path: Path) -> None:
    """Guards the test above against passing vacuously."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from loopserve.runner.setup import build_runner\n")
    assert _imports(bad) == ["loopserve.runner.setup"]
    assert not any(_covers(entry, "runner.setup") for entry in ALLOWED["engine"])


# The one module that imports Ray (the `ray` extra); everything else must run without it.
RAY_MODULE = "loopserve.ray.app"


def _imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
            alias.name.split(".")[0] == "ray" for alias in node.names
        ):
            return True
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        if module.split(".")[0] == "ray" and isinstance(node, ast.ImportFrom) and node.level == 0:
            return True
    return False


def test_only_the_ray_package_entry_imports_ray(tmp_path: Path) -> None:
    importers = [_module_name(path) for path in sorted(PACKAGE.rglob("*.py")) if _imports_ray(path)]
    assert importers == [RAY_MODULE]
    guard = tmp_path / "guard.py"
    guard.write_text("def f():\n    from ray import serve\n")
    assert _imports_ray(guard)  # the check sees imports inside functions


def test_import_loopserve_stays_light() -> None:
    code = (
        "import sys, loopserve, loopserve.ray, loopserve.ray.routing; "
        "print(','.join(m for m in ('ray', 'torch', 'fastapi') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()}"


STUB_ENGINE = """
import sys
from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.engine.runner_api import RunnerInfo
from loopserve.engine.scheduler_output import RunnerOutput, SampledToken
from loopserve.models.ouro_config import OuroConfig
from loopserve.sampling_params import SamplingParams

class Done:
    def __init__(self, output): self.output = output
    def result(self): return self.output

class StubRunner:
    info = RunnerInfo(OuroConfig(), None, 64, 512, 16, "cpu", "float32", "stub", False, 1)
    def execute(self, scheduled):
        tokens = [SampledToken(7, None) for _ in scheduled.prefill_chunks]
        return Done(RunnerOutput(tokens))

engine = Engine(EngineConfig(), runner=StubRunner())
engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
(output,) = engine.step()
assert output.finished and output.outputs[0].token_ids == [7], output
print(",".join(m for m in ("torch", "loopserve.runner") if m in sys.modules))
"""


def test_the_engine_runs_on_a_handed_runner_without_torch_or_the_runner_package() -> None:
    result = subprocess.run(
        [sys.executable, "-c", STUB_ENGINE], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()}"
