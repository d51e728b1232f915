"""The `loopserve` command line: `generate` end to end on the built-in model (what the README's
first command runs), its flags generated from `SamplingParams`, one-line errors (exit code 2)
naming the flag, `--log-level` anywhere, device and port errors, and Ctrl-C (exit code 130)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from loopserve.entrypoints.cli import build_parser, main
from loopserve.entrypoints.cli.sampling_args import sampling_params
from loopserve.sampling_params import SamplingParams
from tests.server.server_testing import sigint_as_default

CLI = "import sys; from loopserve.entrypoints.cli import main; sys.exit(main())"


def test_generate_with_the_builtin_model_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["generate", "--prompt", "def fibonacci(n):", "--prompt-ids", "5,6,7",
         "--max-tokens", "6", "--exit-threshold", "0.5", "--json"]
    )  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["def fibonacci(n):", [5, 6, 7]]
    for record in records:
        assert len(record["token_ids"]) == len(record["exit_depths"]) == 6
        assert record["exit_depths"][0] == 4 and record["finish_reason"] == "length"
    assert records[0]["text"]


def test_generate_prints_every_sequence_of_n(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt-ids", "5,6", "--max-tokens", "3", "--n", "2", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["index"] for record in records] == [0, 1]


def test_generate_without_a_tokenizer_wants_token_ids(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from loopserve.models.checkpoint_writer import write_random_checkpoint
    from loopserve.models.ouro_config import OuroConfig

    config = OuroConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    write_random_checkpoint(tmp_path, config)
    (tmp_path / "model.safetensors").write_bytes(b"")  # would fail to load: checked before
    assert main(["generate", "--model", str(tmp_path), "--prompt", "a"]) == 2
    assert "has no tokenizer.json: give the prompts as token ids" in capsys.readouterr().err


def test_generate_reports_bad_input_clearly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "a"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["generate", "--prompt", "a", "--max-loops", "9"]) == 2
    assert "exceeds the model's loop count" in capsys.readouterr().err


def test_generate_flags_are_sampling_params_with_its_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["generate"])
    assert sampling_params(args, SamplingParams()) == SamplingParams()
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for item in fields(SamplingParams):
        flag = "--" + item.name.replace("_", "-")
        assert flag in help_text
        if item.default not in (None, ()):
            assert f"{item.metadata['help']} (default: {item.default})" in help_text, flag
    args = build_parser().parse_args(
        [
            "generate",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop-token-ids",
            "3,4",
            "--no-skip-special-tokens",
        ]
    )
    params = sampling_params(args, SamplingParams())
    assert (params.stop, params.stop_token_ids, params.skip_special_tokens) == (
        ("a", "b"),
        (3, 4),
        False,
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--temperature", "nan"], ["--temperature", "inf"], ["--top-p", "-inf"],
        ["--exit-threshold", "nan"], ["--max-tokens", "2.5"], ["--min-p", "x"],
    ],
)  # fmt: skip
def test_generate_refuses_non_finite_and_non_integer_numbers(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--prompt", "a", *flags])
    assert caught.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "2"], "--top-p: top_p must be in (0, 1]"),
        (["--logprobs", "21"], "--logprobs: logprobs must be between 0 and 20"),
        (["--exit-threshold", "0"], "--exit-threshold: exit_threshold must be in (0, 1]"),
        (["--stop", ""], "--stop: stop strings must not be empty"),
    ],
)
def test_generate_sampling_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["generate", "--prompt", "a", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_log_level_goes_before_or_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["generate"]).log_level == "warning"
    assert parser.parse_args(["--log-level", "info", "generate"]).log_level == "info"
    assert parser.parse_args(["generate", "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["bench", "serve", "--log-level", "error"]).log_level == "error"
    assert main(["generate", "--prompt", "a", "--log-level", "verbose"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loopserve: error: --log-level must be one of debug, info, warning")
    assert len(err.splitlines()) == 1
    assert main(["--log-level", "loud", "serve"]) == 2


def test_device_errors_name_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a cuda:1")
    assert main(["generate", "--prompt", "a", "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "'cuda:1'" in err and "device='cpu'" in err and "--device cpu" in err


def test_python_users_are_not_told_to_use_a_flag() -> None:
    import torch

    from loopserve.entrypoints.llm import LLM

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="device 'cuda' was asked for") as caught:
        LLM(device="cuda")
    assert "device='cpu' in Python" in str(caught.value)


def test_serve_checks_its_port_before_loading_the_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("uvicorn", reason="serving needs the `serve` extra")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        missing_model = str(tmp_path / "not-loaded")  # loading it would fail differently
        assert main(["serve", "--port", str(port), "--model", missing_model]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "already in use" in err


def test_ctrl_c_during_generate_is_one_line_and_exit_code_130() -> None:
    command = [
        sys.executable, "-c", CLI, "--log-level", "info", "generate", "--prompt", "x",
        "--max-tokens", "2000", "--ignore-eos",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_default,
    )
    assert process.stderr is not None
    try:
        logged = process.stderr.readline()  # the model is loaded: generation starts
        assert logged.startswith("INFO"), logged
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert "Traceback" not in rest
    assert rest.strip().splitlines()[-1] == "loopserve generate: interrupted"
    assert not [line for line in rest.splitlines() if not line.startswith(("INFO", "loopserve"))]
