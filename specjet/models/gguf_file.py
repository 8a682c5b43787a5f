"""A GGUF file's parsed header and tensor table, read once for all who read it."""

from __future__ import annotations

import functools
import pathlib


def gguf_reader(path: str | pathlib.Path):
    """The file's ``gguf.GGUFReader``, parsed once (its header and tensor table; the data stay memory-mapped) for
    every reader of it while the file is unchanged: the conversion's RoPE fields, the quantized blocks' table."""
    path = pathlib.Path(path).resolve()
    stat = path.stat()
    return _reader_of(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader_of(path: str, size: int, mtime_ns: int):  # size and mtime: a changed file is read again
    from gguf import GGUFReader

    return GGUFReader(path)
