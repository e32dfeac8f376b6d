"""Corrupted GGUF and safetensors files, each loaded in another process: butter's own error or
a model, never a signal (MLX's readers trust the lengths in a file; butter checks them first).

Hypothesis corrupts a small real file of each format — truncations, bit flips and lying
lengths or counts in its header, and for safetensors adversarial values in the JSON header's
fields — and ``load_worker.py``, a long-lived process, loads each through ``Model.load``.
A crash kills the worker: the example fails with the signal, and the worker is restarted.
"""

from __future__ import annotations

import json
import select
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from butter_core.testing.tiny_gguf import (
    Q4_0,
    Q8_0,
    hf_llama_weights,
    llama_metadata,
    to_gguf_layout,
    write_dense_llama,
    write_gguf,
)
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

WORKER = Path(__file__).with_name("load_worker.py")
LIES = [0, 1, 2, 3, 31, 32, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1]
"""Lengths and counts that sit on the edges of 32- and 64-bit arithmetic."""
REPLY_SECONDS = 60
"""How long one file may take to load (a tiny model: well under a second) before it counts as a hang."""
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

pytestmark = pytest.mark.plugin_independent



class Worker:
    """``load_worker.py`` in a subprocess; ``load`` returns its reply, ``crash: <returncode>``, or
    ``hang`` when no reply comes within ``REPLY_SECONDS`` (the worker is then killed)."""

    def __init__(self, cache: Path):
        self.env = {"BUTTER_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
        self.process = self._start()

    def _start(self):
        return subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=self.env)  # fmt: skip

    def load(self, path: Path) -> str:
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], REPLY_SECONDS)[0]:
            self.process.kill()
            self.process.wait()
            self.process = self._start()
            return f"hang: no reply within {REPLY_SECONDS} s"
        reply = self.process.stdout.readline().strip()
        if not reply:
            code = self.process.wait(timeout=30)
            self.process = self._start()
            return f"crash: exit {code}"
        return reply

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    worker = Worker(tmp_path_factory.mktemp("butter-cache"))
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> list[Path]:
    """A dense (float32) and a quantized (Q4_0 and Q8_0) tiny llama GGUF."""
    folder = tmp_path_factory.mktemp("gguf")
    write_dense_llama(folder / "dense.gguf")
    metadata = llama_metadata()
    tensors = to_gguf_layout(hf_llama_weights(np.random.default_rng(1), metadata), metadata)
    quantized = {name: ((Q4_0 if "ffn" in name else Q8_0) if value.ndim == 2 else 0, value) for name, value in tensors.items()}
    write_gguf(folder / "quantized.gguf", quantized, metadata)
    return [folder / "dense.gguf", folder / "quantized.gguf"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec())


def loads_or_says_why(reply: str) -> bool:
    return reply == "ok" or reply.startswith("butter: ")


CORRUPTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, 2**24)),
        st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(0, 7)),
        st.tuples(st.sampled_from([4, 8]), st.integers(0, 2**16), st.one_of(st.sampled_from(LIES), st.integers(0, 2**64 - 1))),
    ),
    min_size=1,
    max_size=3,
)  # fmt: skip
"""Up to three of: cut the file at a byte; flip a bit of the header; write a 4- or 8-byte
little-endian value over the header (positions wrap around the header's length)."""


def corrupt(data: bytes, header_end: int, corruptions) -> bytes:
    out = bytearray(data)
    for how, at, *value in corruptions:
        if not out:
            break
        span = max(1, min(header_end, len(out)) - 8)
        if how == "truncate":
            del out[at % max(1, len(out)) :]
        elif how == "flip":
            out[at % span] ^= 1 << value[0]
        else:
            out[at % span : at % span + how] = (value[0] % 2 ** (8 * how)).to_bytes(how, "little")[: len(out)]
    return bytes(out)


@given(which=st.integers(0, 1), corruptions=CORRUPTIONS)
@FUZZ
def test_corrupted_gguf_files_fail_with_butters_error(which, corruptions, gguf_files, worker, tmp_path_factory):
    original = gguf_files[which].read_bytes()
    path = tmp_path_factory.mktemp("fuzz") / "model.gguf"
    path.write_bytes(corrupt(original, min(len(original), 64 * 1024), corruptions))
    reply = worker.load(path)
    assert loads_or_says_why(reply), reply


ADVERSARIAL = st.one_of(
    st.sampled_from(LIES), st.integers(-(2**64), 2**64), st.floats(allow_nan=False), st.booleans(), st.text(max_size=4),
    st.lists(st.integers(-(2**33), 2**33), max_size=5), st.none(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["F8_E4M3", "U64", "BOOL", "F64", "I8", "Q4", ""]),
)  # fmt: skip
HEADER_EDITS = st.tuples(st.integers(0, 2**16), st.sampled_from(["dtype", "shape", "data_offsets", None]),
                         st.integers(0, 7), ADVERSARIAL)  # fmt: skip
"""(which entry, which field or the whole entry, which element, the value written there)."""


def edit_header(data: bytes, edit) -> bytes:
    """``data`` (a safetensors file) with one field of its JSON header replaced."""
    which, field, element, value = edit
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    name = sorted(header)[which % len(header)]
    if field is None or name == "__metadata__":
        header[name] = value
    elif field == "dtype":
        header[name]["dtype"] = value
    else:
        items = list(header[name][field])
        items[element % len(items)] = value
        header[name][field] = items
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + size :]


@given(change=st.one_of(CORRUPTIONS, HEADER_EDITS))
@FUZZ
def test_corrupted_safetensors_files_fail_with_butters_error(change, model_dir, worker, tmp_path_factory):
    original = (model_dir / "model.safetensors").read_bytes()
    if isinstance(change, tuple):
        changed = edit_header(original, change)
    else:
        changed = corrupt(original, 8 + int.from_bytes(original[:8], "little"), change)
    copy = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(model_dir, copy)
    (copy / "model.safetensors").write_bytes(changed)
    reply = worker.load(copy)
    assert loads_or_says_why(reply), reply


def test_the_originals_load(gguf_files, model_dir, worker, tmp_path):
    """The fuzz starts from files that load: what fails is the corruption."""
    for path in gguf_files:
        assert worker.load(path) == "ok"
    assert worker.load(model_dir) == "ok"
