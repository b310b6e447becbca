"""User-facing errors: each one becomes a single clear message and a non-zero exit, never a traceback."""


class TesseraError(Exception):
    """Bad input from the user (config, data, model, checkpoint, launch). Printed without a traceback."""

    exit_code = 2


class ConfigError(TesseraError):
    """One or more configuration problems, reported together."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


class DataError(TesseraError):
    """A data source that cannot be read or has the wrong shape."""


class ModelError(TesseraError):
    """A model that cannot be found, loaded or built."""
