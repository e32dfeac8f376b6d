"""Text to token ids and back for one model directory, plus its chat template.

``Tokenizer.from_dir`` loads ``tokenizer.json`` through Hugging Face ``tokenizers`` and
reads the special tokens and the chat template from ``tokenizer_config.json``,
``config.json`` and ``generation_config.json`` (a model may end generation on several
ids: Llama 3 Instruct stops on both ``<|end_of_text|>`` and ``<|eot_id|>``).

Chat templates are Jinja, rendered the way Hugging Face ``transformers`` renders them: a
sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, and the special tokens
(``bos_token``, ``eos_token``...) as variables. A rendered chat already holds its special
tokens: encode it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from butter_core.errors import ChatTemplateError, ModelLoadError

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encodes, decodes and renders chats for one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        source: str = "<tokenizer>",
    ):
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.source = source

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of a model directory (``tokenizer.json`` is required)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing tokenizer.json; butter needs a Hugging Face fast tokenizer")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as error:
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({error})") from error
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        model_config = _read_json(model_dir / "config.json")
        generation_config = _read_json(model_dir / "generation_config.json")

        special_tokens = {}
        for name in _SPECIAL_TOKEN_NAMES:
            token = tokenizer_config.get(name)
            if isinstance(token, dict):  # an AddedToken serialised by transformers
                token = token.get("content")
            if isinstance(token, str):
                special_tokens[name] = token

        eos_ids = _ids(model_config.get("eos_token_id")) | _ids(generation_config.get("eos_token_id"))
        eos_id = backend.token_to_id(special_tokens.get("eos_token", ""))
        if eos_id is not None:
            eos_ids.add(eos_id)
        bos_id = backend.token_to_id(special_tokens.get("bos_token", ""))
        if bos_id is None:
            bos_id = model_config.get("bos_token_id")
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            special_tokens=special_tokens,
            chat_template=_chat_template(model_dir, tokenizer_config),
            source=str(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model expects around a
        text (a BOS for most SentencePiece and Llama 3 models, nothing for SmolLM2).
        Special tokens written in ``text`` (``<|im_start|>``) always map to their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for one generation."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **variables
    ) -> str:
        """The prompt text of a chat: ``messages`` are ``{"role": ..., "content": ...}`` dicts.

        ``add_generation_prompt`` ends the prompt with the assistant's turn header; other
        keyword arguments (``tools``, ``documents``...) are passed to the template.
        """
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: the model has no chat template (tokenizer_config.json)")
        template = _compile_chat_template(self.chat_template, self.source)
        context = {**self.special_tokens, **variables}
        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{self.source}: the chat template failed: {error}") from error


class StreamingDetokenizer:
    """Turns generated ids into text pieces as they arrive.

    ``add(id)`` returns the new text, or ``""`` while the ids so far end inside a
    character (a multi-byte UTF-8 sequence split across tokens) or add no text yet;
    ``flush()`` returns whatever is still held back when generation ends. Each step
    decodes only the ids since the last emitted text (plus one step of context so that
    a SentencePiece word's leading space is kept), so a long generation costs no more
    per token than a short one.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoded window
        self._read = 0  # end of what has been emitted

    def add(self, token_id: int) -> str:
        """Take one generated id; return the text it completes."""
        self._ids.append(int(token_id))
        shown, text = self._window()
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(shown) :]
        return ""

    def flush(self) -> str:
        """The text still held back (incomplete characters become U+FFFD)."""
        shown, text = self._window()
        self._prefix = self._read = len(self._ids)
        return text[len(shown) :]

    def _window(self) -> tuple[str, str]:
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip_special)
        return decode(self._ids[self._prefix : self._read]), decode(self._ids[self._prefix :])


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _ids(value) -> set[int]:
    """Token ids from a config value that is an id, a list of ids, or absent."""
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def _chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """The default chat template: ``chat_template.jinja`` if present, else the config's."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str, origin: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"{origin}: the chat template is not valid Jinja: {error}") from error


def _raise_exception(message: str):
    raise jinja2.TemplateError(f"it rejected the messages: {message}")


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
