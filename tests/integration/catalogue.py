"""The catalogue of bad input and faults: each case runs the real entry point (or tool) through a real launcher
and must end with its documented exit code (trainer/errors.py), one message naming the key or file to change,
no traceback and no hang. Every checked case adds a row (case, exit code, seconds, message) to the table that
the test session prints at its end and writes to $TESSERA_CATALOGUE_OUT when that is set."""
from __future__ import annotations

import re
import time
from typing import List, Tuple

ROWS: List[Tuple[str, int, float, str]] = []

_MESSAGE = re.compile(r"^(?:\[rank \d+\] )?(?:error|launch\.sh|stopped|warning)[:\s].*$", re.M)


def message_of(output: str) -> str:
    """The first line the user is meant to read: `error: ...` (with its rank prefix), or a launcher's line."""
    m = _MESSAGE.search(output)
    if not m:
        return ""
    line = m.group(0).strip()
    if line.endswith(":"):  # a list follows: its first item says what is wrong
        rest = output[m.end():].lstrip("\n").splitlines()
        line += " " + rest[0].strip() if rest else ""
    return line


def check_case(case: str, proc, seconds: float, code: int, expected: str, allow_traceback: bool = False) -> str:
    """Assert the case's outcome and record its row; returns the message line."""
    out = proc.stdout + proc.stderr
    tail = out[-4000:]
    assert proc.returncode == code, f"{case}: exit {proc.returncode}, expected {code}\n{tail}"
    assert expected in out, f"{case}: {expected!r} not in the output\n{tail}"
    if not allow_traceback:
        assert "Traceback" not in out, f"{case}: a traceback\n{tail}"
    message = message_of(out) or next((line for line in out.splitlines() if expected in line), "")
    ROWS.append((case, proc.returncode, round(seconds, 1), message[:160]))
    return message


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def table() -> str:
    lines = ["| case | exit code | seconds | message |", "|---|---|---|---|"]
    for case, code, seconds, message in ROWS:
        lines.append(f"| {case} | {code} | {seconds} | {message.replace('|', '/')} |")
    return "\n".join(lines)
