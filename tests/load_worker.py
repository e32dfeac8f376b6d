"""A process that loads model files named on stdin and says, per file, how it went.

``tests/test_fuzz_files.py`` feeds it corrupted GGUF files and model directories: each line
``PATH`` gets ``ok``, ``butter: <message>`` (butter's own error) or ``other: <type>:
<message>`` (anything else, a failure); a signal kills the process, which the test sees
as an empty reply. Loading is ``Model.load`` (a GGUF is converted first) and evaluating
every parameter, so tensor data is read too.
"""

import sys

import mlx.core as mx
from mlx.utils import tree_flatten

from butter_core.errors import ButterError
from butter_core.model import Model

for line in sys.stdin:
    try:
        model = Model.load(line.strip())
        mx.eval([value for _, value in tree_flatten(model.network.parameters())])
        reply = "ok"
    except ButterError as exc:
        reply = f"butter: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
        reply = f"other: {type(exc).__name__}: {exc}"
    print(reply.replace("\n", " "), flush=True)
