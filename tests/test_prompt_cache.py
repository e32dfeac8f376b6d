"""Prompt caches saved to safetensors and loaded back: every scheme, windows, hybrid states, wrong files."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from butter_core import Window
from butter_core.cache import ATTENTION
from butter_core.cli import main
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache
from butter_core.testing.fixtures import example_model
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

SCHEMES = sorted(name for name, r in get_plugin_host().schemes.items() if ATTENTION in r.scheme.layer_types)
TEXT = "Once upon a time there was a tiny model that wrote short stories about a fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("prompt-cache"), TinySpec(family="qwen3"))


def _continue(model: Model, caches, rest: list[int]) -> mx.array:
    """Every position's logits of ``rest`` fed after what ``caches`` hold."""
    return model.engine.forward(rest, caches, all_logits=True)


@pytest.mark.parametrize("window", [None, Window(12, keep=2)], ids=["unbounded", "window12keep2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_loaded_cache_continues_exactly_as_the_saved_one(model_dir, tmp_path, scheme, window):
    """Saved after 20 prompt tokens (a window of 12 has wrapped) and loaded into fresh caches, the cache
    gives the very logits the caches it was saved from give."""
    model = example_model(str(model_dir), scheme, window)
    prompt = model.encode_prompt(TEXT)
    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward(prompt[:20], caches))
    save_prompt_cache(tmp_path / "p.safetensors", model, caches, prompt[:20])
    loaded = load_prompt_cache(tmp_path / "p.safetensors", model)
    assert loaded.tokens == prompt[:20] and loaded.resume(prompt) == 20
    assert mx.array_equal(_continue(model, loaded.caches, prompt[20:]), _continue(model, caches, prompt[20:]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_resume_trims_to_the_common_prefix(model_dir, tmp_path, scheme):
    """A prompt that parts from the saved one after 9 tokens reuses those 9, as the saved caches trimmed
    in memory do (``trim``: exact for raw, within each scheme's conformance tolerance for the others);
    an identical prompt keeps all but its last token."""
    model = example_model(str(model_dir), scheme)
    prompt = model.encode_prompt(TEXT)
    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward(prompt, caches))
    save_prompt_cache(tmp_path / "p.safetensors", model, caches, prompt)
    other = prompt[:9] + [t + 1 for t in prompt[9:14]]
    loaded = load_prompt_cache(tmp_path / "p.safetensors", model)
    assert loaded.resume(other) == 9 and loaded.caches[0].absolute_position == 9
    assert all(cache.trim(len(prompt) - 9) == len(prompt) - 9 for cache in caches)
    assert mx.array_equal(_continue(model, loaded.caches, other[9:]), _continue(model, caches, other[9:]))
    if scheme == "raw":  # no state beside its slots: trimmed is as if fed the 9 tokens alone, to float rounding
        fresh = model.engine.make_layer_caches()
        mx.eval(model.engine.forward(other[:9], fresh))
        again = load_prompt_cache(tmp_path / "p.safetensors", model)
        again.resume(other)
        got, expected = _continue(model, again.caches, other[9:]), _continue(model, fresh, other[9:])
        assert (mx.abs(got - expected).max() / mx.abs(expected).max()).item() < 1e-5
    assert load_prompt_cache(tmp_path / "p.safetensors", model).resume(prompt) == len(prompt) - 1


@pytest.mark.usefixtures("raw_scheme")
def test_generate_reuses_the_file_and_prints_the_same_text(capsys, model_dir, tmp_path):
    """``butter generate --prompt-cache``: the first run writes the file, the second reuses all but the
    last prompt token and prints the same greedy text; a longer prompt reuses the whole saved one."""
    path = str(tmp_path / "chat.safetensors")
    argv = ["generate", "-m", str(model_dir), "-p", TEXT, "--max-tokens", "8", "--prompt-cache", path]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    second = capsys.readouterr()
    assert second.out == first.out
    tokens = len(example_model(str(model_dir), "raw").encode_prompt(TEXT))
    assert f"0 of {tokens} prompt tokens reused" in first.err
    assert f"{tokens - 1} of {tokens} prompt tokens reused" in second.err and f"after {tokens - 1} held" in second.err
    assert main([*argv[:4], TEXT + " and a dog", *argv[5:]]) == 0
    assert f"{tokens} of" in capsys.readouterr().err


@pytest.mark.usefixtures("raw_scheme")
@pytest.mark.parametrize("family", ["mamba2", "qwen3_next"])
def test_hybrid_states_are_saved_and_resumed_only_forward(tmp_path, family_model, family):
    """Recurrent states round-trip exactly; a prompt that extends the saved one reuses it whole, one
    that parts from it cannot trim a recurrent state and starts from empty caches."""
    if "ssm" not in get_plugin_host().schemes:
        pytest.skip("needs butter-ssm")
    model = Model.load(str(family_model(family)))
    prompt = model.encode_prompt(TEXT)
    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward(prompt[:10], caches))
    save_prompt_cache(tmp_path / "h.safetensors", model, caches, prompt[:10])
    loaded = load_prompt_cache(tmp_path / "h.safetensors", model)
    assert loaded.resume(prompt) == 10
    assert mx.array_equal(_continue(model, loaded.caches, prompt[10:]), _continue(model, caches, prompt[10:]))
    parted = load_prompt_cache(tmp_path / "h.safetensors", model)
    assert parted.resume(prompt[:5] + [7, 8, 9]) == 0 and parted.caches[0].absolute_position == 0


@pytest.fixture
def saved(model_dir, tmp_path):
    model = example_model(str(model_dir), "raw")
    prompt = model.encode_prompt(TEXT)
    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward(prompt, caches))
    path = tmp_path / "p.safetensors"
    save_prompt_cache(path, model, caches, prompt)
    return path


@pytest.mark.usefixtures("raw_scheme")
def test_a_file_of_another_model_scheme_or_window_is_refused_naming_it(saved, model_dir, tmp_path):
    other = write_tiny_model(tmp_path / "other", TinySpec(family="qwen3", seed=5))
    cases = [
        (Model.load(str(other)), "saved for another model"),
        (example_model(str(model_dir), "affine", None) if "affine" in SCHEMES else None, "saved with kv_cache raw"),
        (example_model(str(model_dir), "raw", Window(8, keep=2)), "saved with eviction none"),
    ]
    for model, message in cases:
        if model is None:
            continue
        with pytest.raises(PromptCacheError) as info:
            load_prompt_cache(saved, model)
        assert str(saved) in str(info.value) and message in str(info.value)


@pytest.mark.usefixtures("raw_scheme")
def test_a_file_of_another_tensor_parallel_rank_is_refused(saved, model_dir, tmp_path):
    arrays, meta = mx.load(str(saved), return_metadata=True)
    other = tmp_path / "rank1.safetensors"
    mx.save_safetensors(str(other), arrays, metadata={**meta, "shard": "1/2"})
    with pytest.raises(PromptCacheError, match="saved by tensor-parallel rank/ranks 1/2; this process is 0/1"):
        load_prompt_cache(other, example_model(str(model_dir), "raw"))


@pytest.mark.usefixtures("raw_scheme")
def test_unreadable_files_are_refused_naming_them(saved, model_dir, tmp_path):
    model = example_model(str(model_dir), "raw")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(saved.read_bytes()[:200])
    plain = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(plain), {"x": mx.zeros(3)})
    for path, message in [(tmp_path / "none.safetensors", "no such prompt-cache file"),
                          (truncated, "not a readable safetensors file"), (plain, "not a butter prompt cache")]:  # fmt: skip
        with pytest.raises(PromptCacheError) as info:
            load_prompt_cache(path, model)
        assert str(path) in str(info.value) and message in str(info.value)
    header = json.loads(saved.read_bytes()[8 : 8 + int.from_bytes(saved.read_bytes()[:8], "little")])
    assert header["__metadata__"]["kv_cache"] == "raw" and header["__metadata__"]["positions"] == str(len(
        model.encode_prompt(TEXT)))  # fmt: skip


@pytest.mark.usefixtures("raw_scheme")
def test_a_failed_save_leaves_the_old_file_and_nothing_half_written(saved, model_dir, monkeypatch):
    model = example_model(str(model_dir), "raw")
    before = saved.read_bytes()
    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward([1, 2, 3], caches))

    def fail(file, arrays, metadata=None):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", fail)
    with pytest.raises(OSError):
        save_prompt_cache(saved, model, caches, [1, 2, 3])
    assert saved.read_bytes() == before and sorted(p.name for p in saved.parent.iterdir()) == [saved.name]
