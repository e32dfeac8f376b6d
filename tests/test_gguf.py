"""GGUF to MLX model directory: names, config, Q/K un-permutation, quantized triplets,
atomic writes and the conversion cache, on tiny GGUF files written here
(``butter_core.testing.tiny_gguf``)."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import threading

import mlx.core as mx
import numpy as np
import pytest

from butter_core.cli import main
from butter_core.errors import ModelLoadError
from butter_core.loading.gguf import (
    CONVERTER_VERSION,
    LOCK_FILE,
    cached_conversion_dir,
    conversion_lock,
    convert_gguf,
    convert_gguf_cached,
    file_sha256,
    unpermute_rope_rows,
)
from butter_core.loading.gguf_header import check_gguf
from butter_core.testing.tiny_gguf import (
    CHAT_TEMPLATE,
    F16,
    F32,
    Q4_0,
    Q4_1,
    Q8_0,
    TOKENS,
    hf_llama_weights,
    llama_metadata,
    llama_permute,
    save_gguf_mlx,
    to_gguf_layout,
    write_dense_llama,
    write_gguf,
)
from butter_core.tokenizer import Tokenizer


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTTER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _dense_llama(tmp_path, *, tied=True, **metadata_overrides):
    path = tmp_path / "tiny.gguf"
    hf, metadata = write_dense_llama(path, tied=tied, **metadata_overrides)
    return path, hf, metadata


def test_dense_llama_becomes_a_hugging_face_directory(tmp_path):
    path, hf, _ = _dense_llama(tmp_path)
    model_dir = convert_gguf(path, tmp_path / "model")

    assert sorted(os.listdir(model_dir)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert set(weights) == set(hf)  # tied: no lm_head
    for name, value in hf.items():
        assert weights[name].shape == value.shape and weights[name].dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(weights[name]), value, err_msg=name)

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    expected = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "head_dim": 16,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256 and config["vocab_size"] == hf["model.embed_tokens.weight"].shape[0]
    assert config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    assert "quantization" not in config

    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.encode("the the") == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġthe")]
    assert tokenizer.decode(tokenizer.encode("the band, 42")) == "the band, 42"


def test_untied_model_keeps_lm_head(tmp_path):
    path, hf, _ = _dense_llama(tmp_path, tied=False)
    model_dir = convert_gguf(path, tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is False
    lm_head = mx.load(str(model_dir / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_array_equal(np.array(lm_head), hf["lm_head.weight"])


def test_end_of_turn_token_also_ends_generation(tmp_path):
    path, _, _ = _dense_llama(tmp_path, **{"tokenizer.ggml.eot_token_id": 0})
    model_dir = convert_gguf(path, tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == [2, 0]
    assert Tokenizer.from_dir(model_dir).eos_token_ids == {0, 2}


def test_qwen3_keeps_qk_rows_and_gets_its_qk_norms(tmp_path):
    llama = llama_metadata(layers=1, **{"llama.attention.key_length": 16})
    hf = hf_llama_weights(np.random.default_rng(3), llama)
    tensors = to_gguf_layout(hf, llama, permute=False)
    tensors |= {f"blk.0.attn_{name}_norm.weight": np.ones(16, np.float32) for name in "qk"}
    metadata = {key.replace("llama.", "qwen3.", 1): value for key, value in llama.items()}
    metadata["general.architecture"] = "qwen3"
    model_dir = convert_gguf(save_gguf_mlx(tmp_path / "qwen3.gguf", tensors, metadata), tmp_path / "model")

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == 16
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (16,)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(np.array(weights[name]), hf[name])


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        restored = unpermute_rope_rows(mx.array(llama_permute(rows, heads)), heads)
        np.testing.assert_array_equal(np.array(restored), rows)


def _roped_scores(x, q_weight, k_weight, *, traditional, theta=500.0):
    """Per-head attention logits of ``x`` (tokens, 64) after RoPE, for 4 query and 2 KV heads."""

    def heads(weight, n):
        projected = (x @ weight.T).reshape(x.shape[0], n, -1).swapaxes(0, 1)[None]
        return mx.fast.rope(projected, projected.shape[-1], traditional=traditional, base=theta, scale=1.0, offset=0)

    q, k = heads(q_weight, 4), heads(k_weight, 2)
    return q @ mx.repeat(k, 2, axis=1).swapaxes(-1, -2)


def test_converted_qk_with_rotate_half_rope_matches_gguf_with_interleaved_rope(tmp_path):
    """llama.cpp runs GGUF Q/K with interleaved RoPE; the converted Q/K must give the same
    attention logits with Hugging Face's rotate-half RoPE (MLX ``traditional=False``)."""
    path, _, _ = _dense_llama(tmp_path, theta=500.0)
    model_dir = convert_gguf(path, tmp_path / "model")
    gguf = mx.load(str(path))
    hf = mx.load(str(model_dir / "model.safetensors"))
    x = mx.random.normal((7, 64), key=mx.random.key(1))
    for layer in range(2):
        gguf_qk = gguf[f"blk.{layer}.attn_q.weight"], gguf[f"blk.{layer}.attn_k.weight"]
        hf_qk = (hf[f"model.layers.{layer}.self_attn.{name}_proj.weight"] for name in "qk")
        reference = np.array(_roped_scores(x, *gguf_qk, traditional=True))
        converted = np.array(_roped_scores(x, *hf_qk, traditional=False))
        np.testing.assert_allclose(converted, reference, rtol=1e-4, atol=1e-3)
        unconverted = np.array(_roped_scores(x, *gguf_qk, traditional=False))
        assert not np.allclose(unconverted, reference, atol=1e-2)  # the check can fail


@pytest.mark.parametrize("ggml_type, bits, error", [(Q4_0, 4, 0.15), (Q4_1, 4, 0.15), (Q8_0, 8, 0.01)])
def test_quantized_tensors_stay_quantized_with_rows_unpermuted(tmp_path, ggml_type, bits, error):
    metadata = llama_metadata()
    hf = hf_llama_weights(np.random.default_rng(1), metadata)
    gguf_layout = to_gguf_layout(hf, metadata)
    types = {name: (ggml_type if value.ndim == 2 else F32) for name, value in gguf_layout.items()}
    stored = write_gguf(tmp_path / "q.gguf", {n: (types[n], v) for n, v in gguf_layout.items()}, metadata)

    loaded = mx.load(str(tmp_path / "q.gguf"))  # what MLX's reader makes of ggml blocks
    assert loaded["blk.0.attn_q.weight"].dtype == mx.uint32
    assert loaded["blk.0.attn_q.weight"].shape == (64, 64 * bits // 32)
    assert loaded["blk.0.attn_q.scales"].dtype == mx.float16 and loaded["blk.0.attn_q.scales"].shape == (64, 2)
    assert loaded["blk.0.attn_q.biases"].dtype == mx.float16 and loaded["blk.0.attn_q.biases"].shape == (64, 2)

    model_dir = convert_gguf(tmp_path / "q.gguf", tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": bits}
    weights = mx.load(str(model_dir / "model.safetensors"))
    heads = {"q_proj": 4, "k_proj": 2}
    for (name, value), gguf_name in zip(hf.items(), gguf_layout):
        if value.ndim == 1:
            continue
        module = name.removesuffix(".weight")
        assert weights[name].dtype == mx.uint32 and weights[module + ".scales"].dtype == mx.float16, name
        scales, biases = weights[module + ".scales"], weights[module + ".biases"]
        converted = np.array(mx.dequantize(weights[name], scales, biases, group_size=32, bits=bits).astype(mx.float32))
        expected = stored[gguf_name]
        projection = module.rsplit(".", 1)[-1]
        if projection in heads:  # GGUF row i holds Hugging Face row order[i]
            order = llama_permute(np.arange(len(expected)), heads[projection])
            expected = np.empty_like(expected)
            expected[order] = stored[gguf_name]
        np.testing.assert_allclose(converted, expected, rtol=2e-3, atol=2e-3, err_msg=name)
        assert np.abs(converted - value).mean() < error, name  # rows in place: only quantization error left


def test_mixed_quantization_is_described_per_module(tmp_path):
    metadata = llama_metadata(layers=1)
    gguf_layout = to_gguf_layout(hf_llama_weights(np.random.default_rng(2), metadata), metadata)
    types = {name: (Q4_1 if value.ndim == 2 else F32) for name, value in gguf_layout.items()}
    types["token_embd.weight"] = Q8_0
    types["blk.0.attn_v.weight"] = F16
    write_gguf(tmp_path / "mixed.gguf", {n: (types[n], v) for n, v in gguf_layout.items()}, metadata)
    config = json.loads((convert_gguf(tmp_path / "mixed.gguf", tmp_path / "model") / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        "model.layers.0.self_attn.v_proj": False,
    }


def test_truncated_gguf_is_a_model_load_error_naming_the_file(tmp_path):
    path, _, _ = _dense_llama(tmp_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated.gguf.*past the end of the file"):
        convert_gguf(truncated, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_unsupported_architecture_is_named(tmp_path):
    path, _, _ = _dense_llama(tmp_path, **{"general.architecture": "mamba"})
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba' in .*tiny.gguf"):
        convert_gguf(path, tmp_path / "model")


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path, _, _ = _dense_llama(tmp_path, **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match=r"unsupported tokenizer model 'bert' in .*tiny.gguf"):
        convert_gguf(path, tmp_path / "model")


def test_failure_midway_leaves_no_destination(tmp_path):
    """Q and K rows do not match the heads the metadata promises: the tensors fail after the
    tokenizer files are already staged, and nothing is left behind."""
    path, _, _ = _dense_llama(tmp_path, **{"llama.attention.head_count": 5, "llama.attention.key_length": 16})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelLoadError, match="has (60|24) rows, not (5|2) heads of 16"):
        convert_gguf(path, out / "model")
    assert os.listdir(out) == []


def test_existing_destination_is_refused(tmp_path):
    path, _, _ = _dense_llama(tmp_path)
    (tmp_path / "model").mkdir()
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_gguf(path, tmp_path / "model")


def test_conversion_is_cached_by_content(tmp_path, cache_dir):
    path, _, _ = _dense_llama(tmp_path)
    first = convert_gguf_cached(path)
    assert first.is_relative_to(cache_dir / "gguf")
    written = (first / "model.safetensors").stat().st_mtime_ns
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(path, renamed)
    assert convert_gguf_cached(renamed) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in first.parent.iterdir()) == [LOCK_FILE, first.name]  # no staging leftovers


def test_missing_gguf_is_named(tmp_path, cache_dir):
    with pytest.raises(ModelLoadError, match="nope.gguf: GGUF file not found"):
        convert_gguf_cached(tmp_path / "nope.gguf")


def test_the_next_conversion_removes_what_a_killed_one_left(tmp_path, cache_dir):
    path, _, _ = _dense_llama(tmp_path)
    directory = cache_dir / "gguf" / f"v{CONVERTER_VERSION}"
    stale = directory / f".{'ab' * 32}.{'0' * 16}.partial"
    (stale / "sub").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    foreign = directory / ".not-ours.partial"
    foreign.mkdir()
    converted = convert_gguf_cached(path)
    assert not stale.exists() and foreign.is_dir()
    assert sorted(p.name for p in directory.iterdir()) == sorted([LOCK_FILE, foreign.name, converted.name])


def test_a_conversion_waits_for_the_process_converting_before_it(tmp_path, cache_dir):
    """The lock is real (``flock``): a second holder blocks until the first lets go, then finds
    the work done instead of doing it again."""
    path, _, _ = _dense_llama(tmp_path)
    directory = cache_dir / "gguf" / f"v{CONVERTER_VERSION}"
    said, result = io.StringIO(), []
    with conversion_lock(directory):
        waiter = threading.Thread(target=lambda: result.append(convert_gguf_cached(path, progress_stream=said)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and said.getvalue() == f"waiting for another butter process converting into {directory}\n"
        converted = convert_gguf(path, cached_conversion_dir(file_sha256(path)))  # what the first process does
    waiter.join(timeout=30)
    assert result == [converted]
    assert len(said.getvalue().splitlines()) == 1  # it did not convert again


def test_a_conversion_shows_its_steps(tmp_path):
    said = io.StringIO()
    convert_gguf(_dense_llama(tmp_path)[0], tmp_path / "model", progress_stream=said)
    assert said.getvalue().splitlines() == [
        "converting tiny.gguf (once) [--------------------] 0/4 reading",
        "converting tiny.gguf (once) [#####---------------] 1/4 tokenizer",
        "converting tiny.gguf (once) [##########----------] 2/4 tensors",
        "converting tiny.gguf (once) [###############-----] 3/4 writing model.safetensors",
        "converting tiny.gguf (once) [####################] 4/4 done",
    ]


def _gguf(kvs=(), tensors=(), data=b"", *, version=3, magic=b"GGUF") -> bytes:
    """GGUF bytes from raw key/value and tensor-info entries (counts from the entries)."""
    out = magic + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return out + b"\0" * (-len(out) % 32) + data


def _key(name: bytes, value: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name + value


def _tensor(name=b"t.weight", dims=(32, 2), ggml_type=0, offset=0, n_dims=None) -> bytes:
    n_dims = len(dims) if n_dims is None else n_dims
    return struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}QIQ", n_dims, *dims, ggml_type, offset)


STRING = struct.pack("<I", 8)
ARCH = _key(b"general.architecture", STRING + struct.pack("<Q", 5) + b"llama")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # The issue's reproduction: a key length of 2**62 (a segfault in MLX's reader).
        (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**62) + bytes(32), "metadata key 0 at byte 24 claims 4611686018427387904 bytes"),
        (b"GGUF" + struct.pack("<I", 3), " \\(8 bytes; a GGUF header alone takes 24\\)"),
        (_gguf(magic=b"GGML"), "it starts with b'GGML', not b'GGUF'"),
        (_gguf(version=1), "GGUF version 1 is not supported"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40), "cannot fit in 24 bytes"),
        (_gguf([ARCH], [_tensor(dims=(32,), n_dims=0xFFFFFFFF)], bytes(128)), "has 4294967295 dimensions"),
        (_gguf([ARCH], [_tensor(dims=(0, 2))], bytes(128)), r"dimensions \[0, 2\]"),
        (_gguf([ARCH], [_tensor(ggml_type=4)], bytes(128)), "unknown ggml type 4"),
        (_gguf([ARCH], [_tensor(ggml_type=30)], bytes(128)), "ggml type BF16, which MLX's GGUF reader does not convert"),
        (_gguf([ARCH], [_tensor(dims=(16, 2), ggml_type=2)], bytes(128)), "rows of 16 are not whole Q4_0 blocks of 32"),
        (_gguf([ARCH], [_tensor()], bytes(100)), "ends at byte .*past the end of the file"),
        (_gguf([ARCH], [_tensor(offset=8)], bytes(512)), "offset 8 is not a multiple of the alignment 32"),
        (_gguf([ARCH], [_tensor(), _tensor(offset=256)], bytes(512)), "tensor 't.weight' appears twice"),
        (_gguf([ARCH, ARCH]), "metadata key 'general.architecture' appears twice"),
        (_gguf([_key(b"general.alignment", struct.pack("<II", 4, 0))]), "general.alignment 0 is not a power of two"),
        (_gguf([_key(b"general.alignment", struct.pack("<IQ", 10, 32))]), "general.alignment must be a uint32, not a uint64"),
        (_gguf([_key(b"a", struct.pack("<IIQ", 9, 9, 1))]), "'a' is an array of arrays"),
        (_gguf([_key(b"a", struct.pack("<IIQ", 9, 5, 2**40))]), "'a' claims 1099511627776 elements"),
        (_gguf([_key(b"a", struct.pack("<IIQ", 9, 5, 1000))]), "the 1000 int32 values of 'a' at byte .* needs 4000 bytes"),
        (_gguf([_key(b"a", struct.pack("<I", 13))]), "'a' has unknown value type 13"),
        (_gguf([_key(b"\xff\xfe", struct.pack("<II", 4, 1))]), "metadata key 0 at byte 32 is not UTF-8"),
    ],
)  # fmt: skip
def test_a_malformed_gguf_is_named_before_mlx_reads_it(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=f"bad.gguf: (not a GGUF file|not a valid GGUF file: .*){message}"):
        convert_gguf(path, tmp_path / "model")
    assert not (tmp_path / "model").exists()


@pytest.mark.usefixtures("raw_scheme")  # the CLI names a missing --kv-cache scheme first
def test_a_malformed_gguf_exits_2_from_the_cli(tmp_path, cache_dir, capsys):
    path = tmp_path / "k.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**62) + bytes(32))
    assert main(["generate", "-p", "hi", "-m", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"butter generate: error: {path}: not a valid GGUF file: metadata key 0 at byte 24 claims "
        "4611686018427387904 bytes (at most 2147483647)\n"
    )


def test_the_header_check_reads_what_the_writer_wrote(tmp_path):
    metadata = llama_metadata()
    tensors = to_gguf_layout(hf_llama_weights(np.random.default_rng(0), metadata), metadata)
    write_gguf(tmp_path / "q.gguf", {name: (Q8_0 if value.ndim == 2 else F32, value) for name, value in tensors.items()},
               metadata)  # fmt: skip
    header = check_gguf(tmp_path / "q.gguf")
    assert header.version == 3 and header.alignment == 32 and list(header.keys) == list(metadata)
    assert [(t.name, t.dims[::-1], t.ggml_type) for t in header.tensors] == [
        (name, value.shape, Q8_0 if value.ndim == 2 else F32) for name, value in tensors.items()
    ]


def test_a_block_count_the_tensors_do_not_have_is_named(tmp_path):
    """Not built: a model of 2**32 - 1 layers took minutes and gigabytes before anything was compared."""
    metadata = llama_metadata()
    tensors = to_gguf_layout(hf_llama_weights(np.random.default_rng(0), metadata), metadata)
    path = save_gguf_mlx(tmp_path / "lying.gguf", tensors, {**metadata, "llama.block_count": 2**32 - 1})
    with pytest.raises(ModelLoadError, match="lying.gguf: llama.block_count is 4294967295, but the file holds blocks 0..1"):
        convert_gguf(path, tmp_path / "model")
