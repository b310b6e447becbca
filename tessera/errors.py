"""User-facing errors: each one becomes a single clear message and a documented exit code, never a traceback.

Exit codes (docs/errors-and-exit-codes.md):
    0    finished, or stopped by SIGTERM/SIGINT after saving a checkpoint
    2    bad input: config, data, model, checkpoint, launch or environment (nothing was trained or lost)
    3    training diverged: a non-finite loss or gradient norm (or a loss spike); the last finite checkpoint is kept
    4    a fault while running: a peer rank died, a collective timed out, a disk filled up or became read-only
    130  interrupted a second time (Ctrl-C twice): stopped at once, without saving
"""
import re
from typing import Optional

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_FAULT = 4
EXIT_INTERRUPTED = 130


class TesseraError(Exception):
    """Bad input from the user (config, data, model, checkpoint, launch). Printed without a traceback."""

    exit_code = EXIT_BAD_INPUT
    # True where every rank reaches the same error from the same input: rank 0 alone prints it (trainer/run/cli.py
    # user_errors; another rank prints it only when rank 0 did not stop the job). A class sets the default, an
    # error that may differ between ranks (a node's own folder) says so with `same_on_every_rank=False`.
    same_on_every_rank = False

    def __init__(self, *args, same_on_every_rank=None):
        super().__init__(*args)
        if same_on_every_rank is not None:
            self.same_on_every_rank = same_on_every_rank


class ConfigError(TesseraError):
    """One or more configuration problems, reported together."""

    same_on_every_rank = True

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


class DataError(TesseraError):
    """A data source that cannot be read or has the wrong shape."""

    same_on_every_rank = True  # every rank reads the same data.path / hub dataset


class ModelError(TesseraError):
    """A model that cannot be found, loaded or built."""

    same_on_every_rank = True  # every rank reads the same model.* config and folder


class DivergenceError(TesseraError):
    """Training produced a non-finite loss or gradient norm (or a loss spike over the configured factor)."""

    exit_code = EXIT_DIVERGED
    same_on_every_rank = True  # judged from the global loss and gradient norm


class FaultError(TesseraError):
    """A fault while running that is not the input's fault: a peer rank died, a collective timed out, the disk
    filled up. The message names what to check or the key to change."""

    exit_code = EXIT_FAULT


class CheckpointError(TesseraError):
    """A checkpoint that cannot be used: missing, damaged, refused (a pickle naming code), or incompatible."""

    same_on_every_rank = True  # every rank checks the same checkpoint folder


class CheckpointSaveError(FaultError):
    """A save that failed while running (disk full, a peer gone): exit code 4; earlier checkpoints are intact."""


# Exceptions whose text alone is a key, an index or a name (str(KeyError(0)) is "0"): a bug of ours or a
# library's, never something the user can act on from that text.
_INTERNAL = (KeyError, IndexError, AttributeError, AssertionError, NameError, ZeroDivisionError, RecursionError,
             NotImplementedError, StopIteration)
_DEBUG_HINT = "rerun with TESSERA_DEBUG=1 for its traceback"


def one_line(e: BaseException, text: Optional[str] = None) -> str:
    """An exception as one line of a user's message, never its bare text: the `[Errno N] ...` part where it has
    one, else its first line; a text that is empty, a single word, number or quoted key (str(KeyError(0)) is
    "0"), or an exception that means a bug (_INTERNAL), is named with its type and what to do. DCP's
    CheckpointException (a rank -> exception map, then tracebacks) becomes its first failure. Every place that
    turns an exception into a message uses this (tests/unit/run/test_messages.py holds them to it). `text`: the
    part of the exception's text the caller picked (instead of str(e)), judged the same way."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, BaseException):
            return f"rank {rank}: {one_line(inner)}"
    text = (str(e) if text is None else text).strip()
    m = re.search(r"(\[Errno \d+\][^\n']*)", text)
    text = m.group(1).rstrip(" :") if m else (text.splitlines()[0].strip()[:300] if text else "")
    internal = isinstance(e, _INTERNAL)
    if not internal and not _bare(text):
        return text
    what = f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} with no message"
    return f"{what} ({'an internal error; ' + _DEBUG_HINT + ' and report it' if internal else _DEBUG_HINT})"


def _bare(text: str) -> bool:
    """Text that says nothing by itself: empty, one word (a number, a key, a name), or one quoted string."""
    return len(text.split()) < 2 or bool(re.fullmatch(r"(['\"]).*\1", text))
