"""User-facing errors: each one becomes a single clear message and a documented exit code, never a traceback.

Exit codes (README "Errors"):
    0    finished, or stopped by SIGTERM/SIGINT after saving a checkpoint
    2    bad input: config, data, model, checkpoint, launch or environment (nothing was trained or lost)
    3    training diverged: a non-finite loss or gradient norm (or a loss spike); the last finite checkpoint is kept
    4    a fault while running: a peer rank died, a collective timed out, a disk filled up or became read-only
    130  interrupted a second time (Ctrl-C twice): stopped at once, without saving
"""
import re

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_FAULT = 4
EXIT_INTERRUPTED = 130


class TesseraError(Exception):
    """Bad input from the user (config, data, model, checkpoint, launch). Printed without a traceback."""

    exit_code = EXIT_BAD_INPUT
    # True where every rank reaches the same error from the same input: rank 0 alone prints it.
    same_on_every_rank = False


class ConfigError(TesseraError):
    """One or more configuration problems, reported together."""

    same_on_every_rank = True

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


class DataError(TesseraError):
    """A data source that cannot be read or has the wrong shape."""


class ModelError(TesseraError):
    """A model that cannot be found, loaded or built."""


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


class CheckpointSaveError(FaultError):
    """A save that failed while running (disk full, a peer gone): exit code 4; earlier checkpoints are intact."""


def one_line(e: BaseException) -> str:
    """The gist of an exception in one line: its `[Errno N] ...` part where it has one, else its first line."""
    text = str(e).strip()
    m = re.search(r"(\[Errno \d+\][^\n']*)", text)
    if m:
        return m.group(1)
    return text.splitlines()[0][:300] if text else type(e).__name__
