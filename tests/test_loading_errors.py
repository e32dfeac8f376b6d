"""Every bad model directory gives a ModelLoadError naming the file and the problem (CLI: exit 2)."""

import json
import shutil

import mlx.core as mx
import pytest

from butter_core.cli import main
from butter_core.errors import ConfigError, ModelLoadError
from butter_core.loading.weights import WeightOptions
from butter_core.model import Model
from butter_core.testing.tiny_models import TinySpec, tiny_config, tiny_weights, write_weights


@pytest.fixture
def model_dir(tiny_model, tmp_path):
    """A private copy of a tiny fp32 llama to break."""
    return shutil.copytree(tiny_model(TinySpec()), tmp_path / "model")


@pytest.fixture
def quantized_dir(tiny_model, tmp_path):
    return shutil.copytree(tiny_model(TinySpec(quantization=(4, 32))), tmp_path / "quantized")


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def load_error(directory, **weight_options) -> str:
    with pytest.raises(ModelLoadError) as info:
        Model.load(str(directory), weights=WeightOptions(**weight_options))
    return str(info.value)


def test_truncated_safetensors(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = load_error(model_dir)
    assert str(weights) in message and "truncated" in message


def test_file_too_short_for_a_header(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x01\x02")
    assert "too short" in load_error(model_dir)


def test_header_that_is_not_json(model_dir):
    (model_dir / "model.safetensors").write_bytes((16).to_bytes(8, "little") + b"not json at all!")
    assert "not valid JSON" in load_error(model_dir)


def _rewrite_header(weights, edit) -> None:
    data = weights.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    edit(header["model.norm.weight"], header)
    raw = json.dumps(header).encode()
    weights.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda entry, _: entry.update(shape=[-2, -64]), r"shape \[-2, -64\] and data_offsets .* must be non-negative integers"),
        (lambda entry, _: entry.update(shape=[64.0]), "must be non-negative integers"),
        (lambda entry, _: entry.update(data_offsets=entry["data_offsets"][::-1]), "the offsets in order"),
        (lambda entry, _: entry.update(dtype=["F32"]), r"unknown dtype \['F32'\]"),
    ],
)
def test_header_entries_must_be_well_formed(model_dir, edit, message):
    weights = model_dir / "model.safetensors"
    _rewrite_header(weights, edit)
    assert message and str(weights) in load_error(model_dir)
    with pytest.raises(ModelLoadError, match=message):
        Model.load(str(model_dir))


def test_a_header_nested_too_deep_for_python(model_dir):
    (model_dir / "model.safetensors").write_bytes((200_000).to_bytes(8, "little") + b"[" * 100_000 + b"]" * 100_000)
    assert "not valid JSON (maximum recursion depth exceeded" in load_error(model_dir)


def test_a_layer_count_the_weights_do_not_hold_is_named_before_building(model_dir):
    edit_config(model_dir, num_hidden_layers=2**32 - 1)
    message = load_error(model_dir)
    assert "config.json: num_hidden_layers is 4294967295, but the weights hold layers 0..1" in message


def test_shape_that_disagrees_with_config(model_dir):
    edit_config(model_dir, intermediate_size=96)
    message = load_error(model_dir)
    assert "model.safetensors" in message and "config.json" in message
    assert "model.layers.0.mlp.down_proj.weight' has shape [128, 128]" in message and "implies [128, 96]" in message


def test_missing_tensor(model_dir):
    weights = tiny_weights(tiny_config(TinySpec()), TinySpec())
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_weights(model_dir, weights)
    message = load_error(model_dir)
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in message and "model.safetensors" in message


def test_unexpected_tensor(model_dir):
    weights = tiny_weights(tiny_config(TinySpec()), TinySpec())
    weights["model.layers.0.self_attn.extra.weight"] = mx.zeros((2, 2))
    write_weights(model_dir, weights)
    assert "unexpected tensor 'model.layers.0.self_attn.extra.weight'" in load_error(model_dir)


def test_integer_tensor_where_floats_belong(model_dir):
    weights = tiny_weights(tiny_config(TinySpec()), TinySpec())
    weights["model.norm.weight"] = mx.ones(weights["model.norm.weight"].shape, dtype=mx.int32)
    write_weights(model_dir, weights)
    assert "'model.norm.weight' has dtype I32" in load_error(model_dir)


@pytest.mark.parametrize(
    "quantization, expected",
    [
        ({"group_size": 32, "bits": 7}, "bits=7"),
        ({"group_size": 48, "bits": 4}, "group_size=48"),
        ({"group_size": 32, "bits": 4, "mode": "mxfp4"}, "mode 'mxfp4'"),
    ],
)
def test_unknown_quantization(quantized_dir, quantization, expected):
    edit_config(quantized_dir, quantization=quantization)
    message = load_error(quantized_dir)
    assert "config.json" in message and expected in message


def test_foreign_quantization_config(model_dir):
    edit_config(model_dir, quantization_config={"quant_method": "gptq", "bits": 4})
    assert "quant_method 'gptq'" in load_error(model_dir)


def test_quantized_tensors_without_quantization_in_config(quantized_dir):
    config = json.loads((quantized_dir / "config.json").read_text())
    del config["quantization"]
    (quantized_dir / "config.json").write_text(json.dumps(config))
    message = load_error(quantized_dir, dequantize=False)
    assert "stored quantized" in message and "config.json" in message


def test_unsupported_architecture(model_dir):
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = load_error(model_dir)
    assert "config.json" in message and "GPT2LMHeadModel" in message
    assert "LlamaForCausalLM (llama)" in message and "Qwen3ForCausalLM (qwen3)" in message


def test_missing_required_key(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    del config["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert "required key 'hidden_size' is missing" in load_error(model_dir)


def test_unsupported_rope_scaling(model_dir):
    edit_config(model_dir, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    message = load_error(model_dir)
    assert "rope_scaling type 'yarn'" in message and "llama3" in message


def test_config_that_is_not_json(model_dir):
    (model_dir / "config.json").write_text("{ nope")
    assert "config.json" in load_error(model_dir)


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    assert "tokenizer.json" in load_error(model_dir)


def test_tokenizer_larger_than_the_model_vocabulary(model_dir):
    edit_config(model_dir, vocab_size=256)
    weights = tiny_weights(tiny_config(TinySpec()) | {"vocab_size": 256}, TinySpec())
    write_weights(model_dir, weights)
    message = load_error(model_dir)
    assert "tokenizer.json" in message and "vocab_size is 256" in message


def test_index_naming_a_missing_shard(tiny_model, tmp_path):
    directory = shutil.copytree(tiny_model(TinySpec(shards=2)), tmp_path / "sharded")
    (directory / "model-00002-of-00002.safetensors").unlink()
    message = load_error(directory)
    assert "model.safetensors.index.json" in message and "model-00002-of-00002.safetensors" in message


def test_invalid_weight_options():
    with pytest.raises(ConfigError, match="WeightOptions.dtype"):
        WeightOptions(dtype="int8")


@pytest.mark.usefixtures("raw_scheme")
def test_cli_reports_a_bad_model_in_one_line_with_exit_2(model_dir, capsys):
    edit_config(model_dir, intermediate_size=96)
    assert main(["generate", "-m", str(model_dir), "-p", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("butter generate: error: ") and "config.json" in err


@pytest.mark.usefixtures("raw_scheme")
def test_cli_reports_a_missing_model_with_exit_2(tmp_path, capsys):
    assert main(["inspect", "-m", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_size_past_mlx_dimensions_is_named(model_dir):
    """MLX's array dimensions are 32-bit: a size of 2**31 (a corrupted GGUF's metadata gave one,
    found by the fuzz test) is a ModelLoadError naming the key, not an OverflowError from MLX."""
    edit_config(model_dir, intermediate_size=2**31)
    assert "'intermediate_size' must be a positive integer below 2**31, got 2147483648" in load_error(model_dir)
