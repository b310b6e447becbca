"""The catalogue of bad input and faults: each case runs the real entry point (or tool) through a real launcher
and must end with its documented exit code (trainer/errors.py), one message naming the key or file to change,
no traceback and no hang. Every checked case adds a row (case, exit code, seconds, message) to the table that
the test session prints at its end and writes to $TESSERA_CATALOGUE_OUT when that is set. Rows also go to the
file $TESSERA_CATALOGUE_ROWS (one JSON list per line) when set: with several pytest workers (pytest-xdist) the
controller, which prints the table, runs no case itself."""
from __future__ import annotations

import json
import os
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
    message = message_of(out)
    if expected not in message:  # one of several listed problems: its own line
        message = next((line.strip(" -") for line in out.splitlines() if expected in line), message)
    record(case, proc.returncode, seconds, message)
    return message


def record(case: str, code: int, seconds: float, message: str) -> None:
    """Add a row to the catalogue (and to the session's shared file, when there is one)."""
    row = (case, code, round(seconds, 1), message[:160])
    ROWS.append(row)
    shared = os.environ.get("TESSERA_CATALOGUE_ROWS")
    if shared:
        with open(shared, "a") as fh:  # one short line per write: appends of several workers do not interleave
            fh.write(json.dumps(row) + "\n")


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def all_rows() -> list:
    """The rows of this process, or of every worker when they share $TESSERA_CATALOGUE_ROWS."""
    shared = os.environ.get("TESSERA_CATALOGUE_ROWS")
    if shared and os.path.exists(shared):
        with open(shared) as fh:
            return [tuple(json.loads(line)) for line in fh if line.strip()]
    return list(ROWS)


def table(rows=None) -> str:
    lines = ["| case | exit code | seconds | message |", "|---|---|---|---|"]
    for case, code, seconds, message in (ROWS if rows is None else rows):
        lines.append(f"| {case} | {code} | {seconds} | {message.replace('|', '/')} |")
    return "\n".join(lines)
