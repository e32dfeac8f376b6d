"""The tokenizer: GGUF vocab rebuilding, encode/decode, special tokens, streaming
detokenization and chat templates, on tiny vocabs written here."""

from __future__ import annotations

import json

import pytest
from tokenizers import pre_tokenizers

from butter_core.errors import ChatTemplateError, ModelLoadError
from butter_core.loading.gguf_tokenizer import build_tokenizer_files
from butter_core.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "( h"]


def byte_level_metadata(pre: str, **extra) -> dict:
    tokens = SPECIALS + BYTES + ["".join(m.split(" ")) for m in MERGES]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


SPM_PIECES = {  # piece: score (a merged piece that scores higher merges earlier)
    "▁": -100.0, "h": -100.0, "e": -100.0, "l": -100.0, "o": -100.0, "w": -100.0, "r": -100.0, "d": -100.0,
    "ll": -1.0, "he": -2.0, "llo": -3.0, "hello": -4.0, "▁hello": -5.0,
    "or": -6.0, "▁w": -7.0, "▁wor": -8.0, "ld": -9.0, "▁world": -10.0,
}  # fmt: skip


def sentencepiece_metadata(**extra) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_PIECES)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(SPM_PIECES.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def tokenizer_from(metadata: dict, tmp_path, **configs) -> Tokenizer:
    """Rebuild the tokenizer files from ``metadata`` into a model dir and load it;
    ``configs`` add files such as ``config={"eos_token_id": 2}``."""
    build_tokenizer_files(metadata, tmp_path / "model.gguf").write(tmp_path)
    for name, content in configs.items():
        path = tmp_path / f"{name}.json"
        current = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(current | content))
    return Tokenizer.from_dir(tmp_path)


def pieces(tokenizer: Tokenizer, text: str, **kwargs) -> list[str]:
    return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text, **kwargs)]


def test_smollm_pre_tokenizer_splits_every_digit(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("smollm"), tmp_path)
    assert pieces(tokenizer, "the 123") == ["t", "he", "Ġ", "1", "2", "3"]
    assert pieces(tokenizer, " the") == ["Ġthe"]


def test_gpt2_pre_tokenizer_keeps_digits_together(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("gpt-2"), tmp_path)
    assert pieces(tokenizer, "the 123") == ["t", "he", "Ġ", "123"]


def test_llama3_pre_tokenizer_adds_bos_and_keeps_punctuation_with_words(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("llama-bpe"), tmp_path)
    assert pieces(tokenizer, "(h") == ["<|im_start|>", "(h"]
    assert pieces(tokenizer, "(h", add_special_tokens=False) == ["(h"]
    assert pieces(tokenizer_from(byte_level_metadata("gpt-2"), tmp_path), "(h") == ["(", "h"]


def test_special_tokens_in_text_map_to_their_ids(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("smollm"), tmp_path)
    ids = tokenizer.encode("<|im_start|>user\nthe<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "<|im_start|>user\nthe<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nthe"


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café 🙂", "def f(x):\n    return x ** 2  # 12\n", " \t\ttabs"])
def test_byte_level_round_trip(tmp_path, text):
    tokenizer = tokenizer_from(byte_level_metadata("smollm"), tmp_path)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_sentencepiece_vocab_merges_by_score_with_byte_fallback(tmp_path):
    tokenizer = tokenizer_from(sentencepiece_metadata(), tmp_path)
    assert pieces(tokenizer, "hello world") == ["<s>", "▁hello", "▁world"]
    assert pieces(tokenizer, "hello é", add_special_tokens=False) == ["▁hello", "▁", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(tokenizer.encode("hello é world"), skip_special_tokens=True) == "hello é world"
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == {2}


def test_sentencepiece_without_space_prefix(tmp_path):
    tokenizer = tokenizer_from(sentencepiece_metadata(**{"tokenizer.ggml.add_space_prefix": False}), tmp_path)
    assert pieces(tokenizer, "hello world", add_special_tokens=False) == ["hello", "▁world"]
    assert tokenizer.decode(tokenizer.encode("hello world")) == "<s>hello world"


def test_unsupported_tokenizer_model_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"unsupported tokenizer model 'bert' in .*model.gguf"):
        build_tokenizer_files({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, tmp_path / "model.gguf")


def test_unknown_pre_tokenizer_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"unsupported pre-tokenizer 'mystery' .* in .*model.gguf"):
        build_tokenizer_files(byte_level_metadata("mystery"), tmp_path / "model.gguf")


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json: missing"):
        Tokenizer.from_dir(tmp_path)


def test_eos_ids_come_from_every_config(tmp_path):
    tokenizer = tokenizer_from(
        byte_level_metadata("smollm"),
        tmp_path,
        config={"eos_token_id": [0, 5]},
        generation_config={"eos_token_id": 7},
        tokenizer_config={"eos_token": "<|im_end|>"},
    )
    assert tokenizer.eos_token_ids == {0, 2, 5, 7}


def test_streaming_holds_back_split_characters(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("smollm"), tmp_path)
    text = "the café 🙂 the end"
    ids = tokenizer.encode(text)
    stream = tokenizer.detokenizer()
    parts = [stream.add(i) for i in ids]
    assert "".join(parts) + stream.flush() == text
    assert all("\ufffd" not in part for part in parts)
    assert parts.count("") == 1 + 3  # é's first byte, the emoji's first three (no merges join them)


def test_streaming_flush_returns_an_unfinished_character(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("smollm"), tmp_path)
    stream = tokenizer.detokenizer()
    assert stream.add(tokenizer.encode("é")[0]) == ""
    assert stream.flush() == "\ufffd"


def test_streaming_keeps_sentencepiece_spaces(tmp_path):
    tokenizer = tokenizer_from(sentencepiece_metadata(), tmp_path)
    stream = tokenizer.detokenizer()
    assert [stream.add(i) for i in tokenizer.encode("hello world hello", add_special_tokens=False)] == [
        "hello",
        " world",
        " hello",
    ]


CHAT = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_template_renders_with_hugging_face_conventions(tmp_path):
    tokenizer = tokenizer_from(
        byte_level_metadata("smollm", **{"tokenizer.chat_template": CHAT}), tmp_path
    )
    messages = [{"role": "user", "content": "café?"}]
    assert tokenizer.apply_chat_template(messages) == '<|im_start|>user: "café?"\nassistant:'
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == '<|im_start|>user: "café?"\n'
    with pytest.raises(ChatTemplateError, match="tools are not supported"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_file_wins_over_the_config(tmp_path):
    tokenizer_from(byte_level_metadata("smollm", **{"tokenizer.chat_template": CHAT}), tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "1"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tokenizer = tokenizer_from(byte_level_metadata("smollm"), tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
