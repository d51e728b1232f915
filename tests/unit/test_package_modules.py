"""What the installed package holds, and that its modules import without circles.

The package is the product (docs/architecture.md, "The product and the workbench"): a module that
tunes or probes kernels belongs in `benchmarks/`, beside the package. So every module of
`loopserve/` is named here, and a new one fails this test until it is added on purpose; a removed
one fails it until its name goes too. The second test fails on any import circle between two of
the package's modules (imports at module level, inside functions and under TYPE_CHECKING alike).
"""

from __future__ import annotations

import ast
from pathlib import Path

import loopserve

PACKAGE = Path(loopserve.__file__).parent

# folder of the package ("" for the top) -> its modules (file stems)
MODULES: dict[str, set[str]] = {
    "": {
        "__init__", "config", "outputs", "reference", "reference_spec", "request",
        "sampling_params", "speculative_config", "structured_outputs", "tokenizer",
    },
    # structured outputs' grammars (llguidance)
    "structured": {"__init__", "grammar"},
    "attention": {"__init__", "base", "paged", "registry", "torch_backend", "triton_backend"},
    "attention/flashinfer": {
        "__init__", "backend", "csr", "fa2", "library", "plan_cache", "prebuild", "prefill", "xqa",
    },
    # the user-facing `loopserve bench offline | serve | compare` and what they need
    "bench": {
        "__init__", "calibration", "checkpoint_cache", "closed_loop", "compare", "depth_gain",
        "engine_pool",
        "figures", "floor", "offline", "offline_args", "plot", "presets", "prompts", "provenance",
        "records",
        "serve_client", "serve_figures", "step_timeline", "summary", "sweep", "sweep_spec",
        "timed_runner", "timeline_summary", "trial",
    },
    "data": {"__init__", "corpus", "windows"},
    "depth": {"__init__", "exit_test", "policy", "trace"},
    "engine": {
        "__init__", "constraints", "detokenizer", "end_of_sequence", "engine", "kv_manager",
        "page_budget", "prefix_cache", "request_slots", "runner_api", "sampling_defaults",
        "scheduler", "scheduler_output", "stats", "step_results",
    },
    "entrypoints": {"__init__", "chat_prompts", "llm", "reasoning", "tool_calls"},
    "entrypoints/cli": {
        "__init__", "__main__", "bench", "engine_args", "eval", "generate", "make_checkpoint",
        "sampling_args", "serve", "train_tiny",
    },
    "entrypoints/openai": {
        "__init__", "app", "auth", "body", "chat_template", "choice_state", "config", "constraints",
        "context", "engine_process", "engine_thread", "errors", "gc_freeze", "generation", "limits",
        "logprobs",
        "metrics", "output_deltas", "paths", "prompts", "protocol", "responses", "server",
        "serving", "serving_chat", "serving_completions", "streaming",
    },
    "eval": {
        "__init__", "early_exit_perplexity", "fingerprint", "gsm8k", "gsm8k_baseline",
        "gsm8k_prompt", "gsm8k_scoring", "perplexity", "plot",
    },
    "kernels": {
        "__init__", "availability", "decode_plan", "decode_row", "decode_state", "decode_tiles",
        "e4m3", "fused_ops", "gemv", "kv_copy", "kv_write", "lanes_state", "matmul", "noise",
        "paged_decode", "paged_prefill", "pdl", "sampling",
    },
    "kv": {"__init__", "layout", "metadata", "pages", "storage", "transfer"},
    "models": {
        "__init__", "builtin", "checkpoint_writer", "families", "generation_config", "huginn",
        "huginn_config", "kv_scales", "layers",
        "loader", "looped", "model_config", "nanbeige", "nanbeige_config", "ops", "ouro", "quant",
        "ouro_config", "window_attention",
    },
    "ray": {
        "__init__", "app", "fleet", "fleet_metrics", "forwarding", "ingress", "prompt_keys",
        "proxy", "replica", "routing",
    },
    "runner": {
        "__init__", "block_tables", "cuda_graphs", "decode_slots", "decode_step", "graph_capture",
        "kv_budget", "model_runner", "prefill", "prompt_graphs", "setup", "speculation",
        "step_record", "swap", "token_masks",
    },
    "sample": {"__init__", "noise", "sampler"},
    "train": {
        "__init__", "config", "export", "looped_forward", "objectives", "pipeline", "progress",
        "stage1", "stage2", "tokenizer_training",
    },
}  # fmt: skip


def _found() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        found.setdefault("" if folder == "." else folder, set()).add(path.stem)
    return found


def _beyond(modules: dict[str, set[str]], others: dict[str, set[str]]) -> list[str]:
    """The paths of `modules` that `others` does not hold."""
    return sorted(
        f"loopserve/{folder}/{name}.py".replace("//", "/")
        for folder, names in modules.items()
        for name in names - others.get(folder, set())
    )


def test_the_package_holds_exactly_the_listed_modules() -> None:
    found = _found()
    unlisted, gone = _beyond(found, MODULES), _beyond(MODULES, found)
    assert not unlisted, (
        f"modules the list does not name: {unlisted}; a kernel-tuning or probing tool belongs "
        "in benchmarks/, a product module goes into MODULES here"
    )
    assert not gone, f"listed modules that no longer exist: {gone}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from a import b` counts `a.b` where `b` is a
    module, else `a`)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in paths else base)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_no_import_circles() -> None:
    circles = _circles(_import_graph())
    assert not circles, (
        "import circles (move the shared piece down into a module of its own):\n"
        + ("\n".join(" <-> ".join(group) for group in circles))
    )


def test_the_circle_check_finds_a_circle() -> None:
    """Guards the test above against passing vacuously."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles(_import_graph() | {"loopserve.config": {"loopserve.engine.engine"}}) != []
