"""Rebuild a Hugging Face ``tokenizer.json`` and ``tokenizer_config.json`` from GGUF metadata.

A GGUF file carries its tokenizer as ``tokenizer.ggml.*`` metadata. Two vocab kinds are
rebuilt, each the way llama.cpp (the reference reader of GGUF) tokenizes it:

- ``gpt2``: byte-level BPE with merges. ``tokenizer.ggml.pre`` names the pre-tokenizer;
  each known name maps to the pre-tokenization of the original Hugging Face tokenizer
  (``_BYTE_LEVEL_PRESETS``). SmolLM2's ``smollm`` is StarCoder's: every digit on its
  own, then GPT-2's regex.
- ``llama``: a SentencePiece vocab with scores. Rebuilt as a BPE whose merges follow the
  scores (a pair merges earlier the higher its merged piece scores) with byte fallback,
  a space prefix, and spaces written as ``▁``.

Any other vocab kind or pre-tokenizer name is a ``ModelLoadError`` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from butter_core.errors import ModelLoadError

# llama.cpp's token types (``tokenizer.ggml.token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _ByteLevelPreset:
    """How one ``tokenizer.ggml.pre`` value pre-tokenizes a byte-level BPE vocab."""

    split_pattern: str | None = None  # run before the byte mapping; None: GPT-2's own regex
    individual_digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False  # a word that is itself a token is not merged (llama 3)
    add_bos: bool = False


_GPT2 = _ByteLevelPreset()
_STARCODER = _ByteLevelPreset(individual_digits=True)
_LLAMA3 = _ByteLevelPreset(split_pattern=_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = _ByteLevelPreset(split_pattern=_QWEN2_SPLIT, nfc=True)

_BYTE_LEVEL_PRESETS = {
    "gpt-2": _GPT2,
    "starcoder": _STARCODER,
    "smollm": _STARCODER,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


@dataclass(frozen=True)
class TokenizerFiles:
    """The contents of ``tokenizer.json`` and ``tokenizer_config.json`` for one model."""

    tokenizer_json: str
    tokenizer_config: dict

    def write(self, directory: Path) -> None:
        """Write both files into ``directory``."""
        (directory / "tokenizer.json").write_text(self.tokenizer_json, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(
            json.dumps(self.tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8"
        )


def eos_token_ids(metadata: Mapping) -> list[int]:
    """Ids that end generation: ``eos``, then ``eot`` and ``eom`` where the GGUF names them."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


def build_tokenizer_files(metadata: Mapping, source: Path) -> TokenizerFiles:
    """The Hugging Face tokenizer files equivalent to the ``tokenizer.ggml.*`` in ``metadata``.

    ``metadata`` holds plain Python values (lists, ints, strings); ``source`` names the
    GGUF file in error messages.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{source}: no tokenizer vocab (tokenizer.ggml.tokens) in the GGUF metadata")
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.tokens must be a list of strings")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ModelLoadError(f"{source}: tokenizer.ggml.token_type must hold one type per token ({len(tokens)})")
    try:
        return _tokenizer_files(metadata, kind, tokens, types, source)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise ModelLoadError(f"{source}: the tokenizer in the GGUF metadata is malformed: {exc}") from exc


def _tokenizer_files(metadata: Mapping, kind, tokens: list, types: list, source: Path) -> TokenizerFiles:
    if kind == "gpt2":
        tokenizer, add_bos = _byte_level_bpe(metadata, tokens, types, source)
    elif kind == "llama":
        tokenizer, add_bos = _sentencepiece_bpe(metadata, tokens, types, source), True
    else:
        raise ModelLoadError(
            f"unsupported tokenizer model {kind!r} in {source}: butter rebuilds 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece) vocabs"
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=token_type != USER_DEFINED, normalized=False)
            for token, token_type in zip(tokens, types)
            if token_type in (CONTROL, USER_DEFINED, UNKNOWN)
        ]
    )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    template = _special_tokens_template(metadata, tokens, add_bos, add_eos, source)
    if template is not None:
        tokenizer.post_processor = template
    return TokenizerFiles(tokenizer.to_str(), _tokenizer_config(metadata, tokens, add_bos, add_eos))


def _byte_level_bpe(metadata: Mapping, tokens: list, types: list, source: Path) -> tuple[HFTokenizer, bool]:
    pre = metadata.get("tokenizer.ggml.pre")
    preset = _BYTE_LEVEL_PRESETS.get(pre)
    if preset is None:
        known = ", ".join(sorted(_BYTE_LEVEL_PRESETS))
        raise ModelLoadError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) in {source}; known: {known}")
    merges = []
    for merge in metadata.get("tokenizer.ggml.merges") or []:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ModelLoadError(f"{source}: malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        merges.append(tuple(pair))
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab, merges, ignore_merges=preset.ignore_merges))
    steps = []
    if preset.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if preset.split_pattern is not None:
        steps.append(pre_tokenizers.Split(Regex(preset.split_pattern), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=preset.split_pattern is None))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if preset.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer, preset.add_bos


def _sentencepiece_bpe(metadata: Mapping, tokens: list, types: list, source: Path) -> HFTokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: a 'llama' tokenizer needs one score per token (tokenizer.ggml.scores)")
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = HFTokenizer(
        models.BPE(
            vocab,
            _merges_by_score(tokens, scores, types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPIECE_SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), escape]) if space_prefix else escape
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_by_score(tokens: list, scores: list, types: list) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's: every split of a normal piece into two normal
    pieces, the highest-scoring merged piece first."""
    normal = {token for token, token_type in zip(tokens, types) if token_type == NORMAL}
    ranked = []
    for token_id, (piece, token_type) in enumerate(zip(tokens, types)):
        if token_type != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _special_tokens_template(
    metadata: Mapping, tokens: list, add_bos: bool, add_eos: bool, source: Path
) -> processors.TemplateProcessing | None:
    """The post-processor that adds BOS and/or EOS, or None when neither is added."""
    if not (add_bos or add_eos):
        return None
    special, before, after = [], [], []
    for wanted, key, side in ((add_bos, "bos_token_id", before), (add_eos, "eos_token_id", after)):
        if not wanted:
            continue
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            raise ModelLoadError(f"{source}: the tokenizer adds a token but tokenizer.ggml.{key} is missing")
        special.append((tokens[token_id], token_id))
        side.append(tokens[token_id])
    single = " ".join([*before, "$A", *after])
    pair = " ".join([*before, "$A", *after, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _tokenizer_config(metadata: Mapping, tokens: list, add_bos: bool, add_eos: bool) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
