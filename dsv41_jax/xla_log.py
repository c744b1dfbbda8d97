"""XLA's slow-compile banners (and the CPU collectives' join notices) kept off the CLIs' stderr; every other byte
passes through unchanged.

XLA logs a multi-line banner (``Very slow compile?  If you want to file a bug, run with envvar
XLA_FLAGS=--xla_dump_to=...``, between lines of asterisks) with ``LOG(ERROR)`` from
``xla/service/slow_operation_alarm.cc`` whenever one compile runs past two minutes, and once more when it ends
(``The operation took ...``). On a CPU the first start of a large model meets it for most of its programs. No XLA
flag or environment variable turns the alarm off: its two minutes are fixed in the source, and the only switches
(``TF_CPP_MIN_LOG_LEVEL``, absl's minimum log level) are global, so they would hide every other XLA error too.

`hide_slow_compile_banners` therefore routes the process's file descriptor 2 (where XLA's C++ logging, Python's
``sys.stderr`` and everything else write) through a small filter process that drops exactly the alarm's log
lines (the ones naming ``slow_operation_alarm.cc``, with the blank, asterisk and "slow compile?" lines of their
message; and gloo's "Rank N is connected to M peer ranks" of a several-process run on CPUs) and forwards the rest
as it arrives (a partial line too, so progress bars still draw). The filter runs in
a session of its own (Ctrl-C reaches only the CLI) and ends when the CLI's stderr closes, so a CLI that crashes
still gets its last words out. A terminal stays a terminal: the filter reads a pseudo-terminal of the terminal's
size, in raw mode (bytes pass unchanged), so progress bars and colours still see one; anything else is read
through a pipe. The CLIs say themselves, once, what they compile and why it can be slow.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import subprocess
import sys

_ALARM = re.compile(rb"slow_operation_alarm\.cc:\d+\]")  # the log line's source location
_BANNER = re.compile(rb"^(\s*|\*+\s*|.*slow compile\?.*)$", re.IGNORECASE)  # the lines of the alarm's message
_LOG_LINE = re.compile(rb"^([EWIF]\d{4} |\d{4}-\d\d-\d\d )")  # absl's and TSL's log line prefixes
_GLOO = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")  # CPU collectives' join, every process


def hide_slow_compile_banners() -> None:
    """Filter this process's stderr as the module docstring says (a CLI calls it first; no-op where it cannot)."""
    opened: list[int] = []
    try:
        original = os.dup(2)
        opened.append(original)
        read_end, write_end = _terminal_like(original) if os.isatty(original) else os.pipe()
        opened += [read_end, write_end]
        proc = subprocess.Popen([sys.executable, "-I", __file__], stdin=read_end, stdout=original,
                                stderr=original, start_new_session=True)
    except Exception:  # noqa: BLE001 - OSError, termios.error, ImportError: stderr stays as it is
        for fd in opened:
            os.close(fd)
        return
    os.close(read_end)
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)

    def restore() -> None:  # the filter sees the end of its input, writes what it holds and exits
        try:
            sys.stderr.flush()
        finally:
            os.dup2(original, 2)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    atexit.register(restore)


def _terminal_like(terminal: int) -> tuple[int, int]:
    """(read end, write end) of a raw pseudo-terminal the size of ``terminal``."""
    import fcntl  # noqa: PLC0415 - POSIX only (the fallback is no filter)
    import termios  # noqa: PLC0415 - POSIX only
    import tty  # noqa: PLC0415 - POSIX only

    master, slave = os.openpty()
    tty.setraw(slave)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(terminal, termios.TIOCGWINSZ, b"\0" * 8))
    return master, slave


def _read(source: int) -> bytes:
    try:
        return os.read(source, 1 << 16)
    except OSError as e:  # a pseudo-terminal whose other side closed reads EIO, not end-of-file
        if e.errno == errno.EIO:
            return b""
        raise


def filter_stream(source: int, out) -> None:
    """Copy file descriptor ``source`` to the binary stream ``out`` until it ends, without XLA's slow-compile
    banners."""
    held, in_banner = b"", False
    while chunk := _read(source):
        lines = (held + chunk).split(b"\n")
        held = lines.pop()  # a line not ended yet
        kept = []
        for line in lines:
            if _ALARM.search(line[:300]) and _LOG_LINE.match(line):
                in_banner = True
            elif _GLOO.match(line):
                continue
            elif not (in_banner and _BANNER.match(line)):
                in_banner = False
                kept.append(line + b"\n")
        if held and not in_banner and not _LOG_LINE.match(held):  # no log line: pass it on now
            kept.append(held)
            held = b""
        if kept:
            out.write(b"".join(kept))
            out.flush()
    if held:
        out.write(held)
        out.flush()


if __name__ == "__main__":  # the filter process
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        filter_stream(0, sys.stdout.buffer)
    except (BrokenPipeError, KeyboardInterrupt):
        pass
