"""Texts shipped with butter for ``butter bench`` and ``butter quality``.

Both are openly licensed and copied verbatim, and each is several thousand tokens
long with the default model's tokenizer:

* ``textwrap.py.txt`` (code, 4,848 tokens): the module ``textwrap.py`` of CPython 3.11.7,
  Copyright (C) 1999-2001 Gregory P. Ward and (C) 2002, 2003 Python Software Foundation,
  distributed under the PSF License Agreement, whose text (with the PSF's notice of
  copyright, as the agreement requires) is ``PSF-LICENSE.txt`` beside it. Stored as
  ``.txt`` so that no tool imports or lints it as part of ``butter_core``.
* ``gpl-3.0.txt`` (prose, 7,639 tokens): the GNU General Public License, version 3, as
  Debian ships it in ``/usr/share/common-licenses/GPL-3``. Copyright (C) 2007 Free Software
  Foundation; "Everyone is permitted to copy and distribute verbatim copies of this
  license document, but changing it is not allowed." It is shipped as a text to read,
  unchanged; it does not license butter (which is Apache-2.0).
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent

CODE_TEXT = DATA_DIR / "textwrap.py.txt"
"""Python source: CPython's ``textwrap.py`` (PSF License)."""

PROSE_TEXT = DATA_DIR / "gpl-3.0.txt"
"""English prose: the text of the GNU GPL version 3 (verbatim copying permitted)."""

DEFAULT_TEXTS = (CODE_TEXT, PROSE_TEXT)
"""What ``butter quality`` evaluates when no ``--text`` is given, code first."""

BENCH_TEXT = PROSE_TEXT
"""The text whose tokens, repeated as needed, make ``butter bench``'s prompts."""
