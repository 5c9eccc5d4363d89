"""Each GGUF file parsed once while a test module reads it.

transformers parses a whole GGUF file with gguf-py's ``GGUFReader`` (for the real tokenizer: ~150k
vocabulary and merges values, one numpy view each, ~3 s of CPU) once for a model's config, once for its
weights and once for a tokenizer: one file three times. Inside ``parsed_once()`` the second and third
parse are the first one's reader again. The reader is read-only (a memmap of the file); a file written
again (another size or mtime) is parsed again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    import gguf

    parse = gguf.GGUFReader
    parsed: dict[tuple, object] = {}

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.fspath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)
        return parsed[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)  # transformers imports it from gguf when it reads a file
        yield
