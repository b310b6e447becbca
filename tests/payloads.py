"""Crafted pickles for the safe-loading tests: each would run a shell command if it were unpickled freely."""
from __future__ import annotations

import os


class SystemCall:
    """Pickles as a call of os.system (GLOBAL posix.system + REDUCE)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _short(text: str) -> bytes:
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def stack_global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle: STACK_GLOBAL(module, name)(arg). With a dotted name, pickle resolves it attribute by
    attribute from the module (`os.system` inside any module that imported os)."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(arg) + b"\x85R."  # TUPLE1 REDUCE STOP
