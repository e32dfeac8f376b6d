"""``butter bench`` on tiny real model directories: JSON keys, byte ratios, progress, plot, errors."""

import json
import sys

import pytest

from butter_core.benchmark import BENCH_KEYS, METADATA_KEYS, decode_budget, decode_together, steady_decode_rate
from butter_core.cli import main
from butter_core.model import Model
from butter_core.cache import ATTENTION
from butter_core.plugins import get_plugin_host
from butter_core.testing.tiny_models import TinySpec

pytestmark = pytest.mark.usefixtures("raw_scheme")

EXPECTED_KEYS = [
    "scheme", "context", "batch", "kv_bytes_allocated", "kv_bytes_live", "state_bytes", "bytes_per_token",
    "bytes_ratio_vs_raw", "peak_memory_bytes", "prefill_tok_s", "decode_tok_s", "decode_tok_s_per_sequence",
]  # fmt: skip
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # the tiny qwen3 model


@pytest.fixture
def model_path(tiny_model):
    return str(tiny_model(TinySpec(family="qwen3")))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_exactly_the_documented_keys_and_raw_is_the_measured_baseline(capsys, model_path, tmp_path):
    report = tmp_path / "bench.json"
    argv = ["bench", "-m", model_path, "--kv-cache", "raw-float16", "--context", "40,80", "--decode-tokens", "3",
            "--repeats", "2"]  # fmt: skip
    code, out, err = run(capsys, *argv, "--json", str(report))
    assert code == 0
    data = json.loads(report.read_text())
    assert list(data) == ["metadata", "results"]
    assert list(BENCH_KEYS) == EXPECTED_KEYS
    assert set(METADATA_KEYS) <= set(data["metadata"])
    assert data["metadata"]["model"] == model_path and data["metadata"]["backend"] in ("cpu", "gpu")
    assert data["metadata"]["repeats"] == 2 and data["metadata"]["decode_tokens"] == 3
    rows = data["results"]
    assert all(list(row) == EXPECTED_KEYS for row in rows)
    # raw is added as the baseline and measured side by side, schemes interleaved per context
    assert [(r["scheme"], r["context"]) for r in rows] == [
        ("raw", 40), ("raw-float16", 40), ("raw", 80), ("raw-float16", 80)
    ]  # fmt: skip
    for r in rows:
        positions = r["context"] + 3
        element_bytes = 4 if r["scheme"] == "raw" else 2  # tiny models are float32
        assert r["bytes_per_token"] == LAYERS * KV_HEADS * HEAD_DIM * 2 * element_bytes
        assert r["kv_bytes_live"] == r["bytes_per_token"] * positions
        assert r["kv_bytes_allocated"] >= r["kv_bytes_live"]
        assert r["bytes_ratio_vs_raw"] == (1.0 if r["scheme"] == "raw" else 0.5)
        assert r["peak_memory_bytes"] >= r["kv_bytes_allocated"] > 0
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    table = [line for line in out.splitlines() if line.startswith("| raw")]
    assert len(table) == 4
    assert "raw-float16 @ 80, round 2/2" in err and err.rstrip().endswith("done")


def test_batch_sizes_run_together_over_pages(capsys, model_path, tmp_path):
    """--batch: B sequences of each context through BatchGeneration; pages hold the positions with
    less than one page per sequence to spare; the aggregate rate is B times the per-sequence one."""
    report = tmp_path / "batch.json"
    code, out, err = run(capsys, "bench", "-m", model_path, "--kv-cache", "raw-float16", "--context", "40",
                         "--decode-tokens", "4", "--batch", "1,3", "--json", str(report))  # fmt: skip
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["metadata"]["batches"] == [1, 3]
    rows = data["results"]
    assert [(r["scheme"], r["batch"]) for r in rows] == [("raw", 1), ("raw-float16", 1), ("raw", 3), ("raw-float16", 3)]
    page = 64
    for r in rows:
        element_bytes = 4 if r["scheme"] == "raw" else 2
        per_position = LAYERS * KV_HEADS * HEAD_DIM * 2 * element_bytes
        assert r["bytes_per_token"] == per_position
        # each of B sequences takes a prefill step's worth of tokens more than --decode-tokens (decode_budget)
        assert r["kv_bytes_live"] <= r["batch"] * (40 + 4 + r["batch"]) * per_position
        assert r["kv_bytes_live"] < r["kv_bytes_allocated"] <= r["kv_bytes_live"] + r["batch"] * page * per_position
        assert r["decode_tok_s_per_sequence"] == pytest.approx(r["decode_tok_s"] / r["batch"])
        assert r["bytes_ratio_vs_raw"] == (1.0 if r["scheme"] == "raw" else 0.5)
    assert "| raw-float16 | 40 | 3 |" in out and "raw-float16 @ 40 x 3" in err


def test_aura_runs_batched_with_its_full_precision_rows_counted(capsys, model_path, tmp_path):
    if "aura" not in get_plugin_host().schemes:
        pytest.skip("needs butter-aura")
    report = tmp_path / "aura.json"
    code, _, err = run(capsys, "bench", "-m", model_path, "--kv-cache", "aura4v2", "--context", "16", "--batch", "2",
                       "--decode-tokens", "2", "--json", str(report))  # fmt: skip
    assert code == 0, err
    (row,) = [r for r in json.loads(report.read_text())["results"] if r["scheme"] == "aura4v2"]
    assert row["batch"] == 2 and row["decode_tok_s"] > 0
    assert row["kv_bytes_allocated"] > row["kv_bytes_live"] > 0


def test_every_installed_scheme_runs(capsys, model_path, tmp_path):
    """Whatever plugins are installed: each attention scheme's first example that fits head_dim 32."""
    names = []
    for registered in get_plugin_host().schemes.values():
        if ATTENTION not in registered.scheme.layer_types:
            continue
        for example in registered.scheme.examples:
            try:
                registered.scheme.parse(example).check_layer(HEAD_DIM)
            except ValueError:
                continue
            names.append(example)
            break
    report = tmp_path / "all.json"
    code, _, err = run(capsys, "bench", "-m", model_path, "--kv-cache", ",".join(names), "--context", "24",
                       "--decode-tokens", "2", "--json", str(report))  # fmt: skip
    assert code == 0, err
    rows = json.loads(report.read_text())["results"]
    assert {row["scheme"] for row in rows} >= set(names) - {"raw"}
    assert all(row["bytes_ratio_vs_raw"] > 0 for row in rows)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-cache", "nosuch9"], "unknown KV cache scheme 'nosuch9'"),
        (["--kv-cache", "raw,,raw-float16"], "empty scheme name"),
        (["--context", "500", "--decode-tokens", "32"], "needs 532 positions, more than the model's window of 512"),
        (["--decode-tokens", "1"], "--decode-tokens must be at least 2"),
        (["--plot", "/nonexistent-dir/bench.png"], "does not exist"),
        (["--json", "/nonexistent-dir/bench.json"], "does not exist"),
        (["--json", "/tmp"], "--json /tmp: is a directory; give a file name"),
        (["--plot", "/"], "--plot /: is a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, model_path, flags, message):
    code, out, err = run(capsys, "bench", "-m", model_path, "--context", "16", *flags)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("butter bench: error: ") and message in err


def test_plot_without_matplotlib_names_the_extra_before_running(capsys, model_path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like to `import`
    code, out, err = run(capsys, "bench", "-m", model_path, "--context", "16", "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "pip install 'butter-core[plot]'" in err


def test_plot_is_a_png(capsys, model_path, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    code, _, _ = run(capsys, "bench", "-m", model_path, "--kv-cache", "raw,raw-float16", "--context", "16,32",
                     "--decode-tokens", "2", "--plot", str(plot))  # fmt: skip
    assert code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_decode_rate_counts_the_steps_where_every_sequence_decodes():
    """Sequence 1 starts two steps after sequence 0 (its prompt took more chunks) and outlives it: the
    window runs from its first token (step 3) to sequence 0's last (step 5)."""
    steps = [(0.1, []), (0.2, [0]), (0.3, [0]), (0.4, [0, 1]), (0.5, [0, 1]), (0.7, [0, 1]), (0.8, [1])]
    first, rate = steady_decode_rate(steps)
    assert first == 0.4 and rate == pytest.approx(4 / 0.3)


def test_a_sequence_that_ends_before_the_last_starts_leaves_no_window():
    first, rate = steady_decode_rate([(0.1, [0]), (0.2, [0]), (0.3, [1]), (0.4, [1])])
    assert first == 0.3 and rate != rate  # NaN


def test_the_decode_budget_outlasts_every_prefill_step():
    """A sequence decodes a token per step while the others prefill: one step per chunk of each prompt."""
    assert decode_budget([40, 40, 40], 512, 4) == 4 + 3
    assert decode_budget([32768] * 16, 4096, 32) == 32 + 16 * 8


def test_extra_tokens_leave_every_sequence_decoding_after_the_window(model_path):
    """``decode_together(..., extra=2)``: the window closes two tokens before the first sequence's
    end, so the next two steps give every sequence a token (what ``gpu_batched.py --split-steps``
    times one at a time), and the first sequence ends with the second."""
    model = Model.load(model_path)
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8)
    generation = model.generate_batch(caches, prefill_chunk=16)
    prompts = [model.encode_prompt(text) for text in ("one two three", "a much longer prompt than the first one")]
    first, rate = decode_together(generation, prompts, 3, extra=2)
    assert rate > 0 and first > 0
    for _ in range(2):
        assert sorted(sequence for sequence, _ in generation.step()) == [0, 1]
    assert generation.active == 1
