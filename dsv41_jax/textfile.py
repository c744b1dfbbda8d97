"""User text files (prompts, configs, indexes) read as UTF-8, with one clear error instead of a traceback: a
missing file, a directory, an unreadable file, or bytes that are not UTF-8 (named by byte offset and line)."""

from __future__ import annotations

from pathlib import Path


class TextFileError(ValueError):
    """A text file the user named that cannot be read as UTF-8 text; the message names the file and why."""


def read_text(path: str | Path, what: str) -> str:
    """The text of ``path`` (``what`` names it in errors: "prompts file", "config file", ...)."""
    path = Path(path)
    if path.is_dir():
        raise TextFileError(f"{what} {path} is a directory, not a file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TextFileError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise TextFileError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TextFileError(f"{what} {path} is not UTF-8 text: byte {e.start:,} (line {line}) is 0x{data[e.start]:02x} "
                            f"({e.reason}); save it as UTF-8") from None
