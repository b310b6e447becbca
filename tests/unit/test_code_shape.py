"""The shape the house keeps (docs/architecture.md, "Rules the layout keeps"): short functions, strategies named
only by the strategy registry and the strategies themselves."""
from __future__ import annotations

import ast

from tests.conftest import REPO

MAX_FUNCTION_LINES = 60
STRATEGY_NAMES = {"single", "ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp", "hsdp", "tp", "pp", "fsdp_tp",
                  "pp_fsdp", "3d"}


def _sources(*tops):
    for top in tops:
        for path in sorted((REPO / top).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), str(path))


def test_no_function_is_longer_than_sixty_lines():
    long = [f"{rel}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for rel, tree in _sources("trainer", "models", "tessera") for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "\n".join(long)


def _compares_a_strategy_name(node) -> bool:
    """`x.name == "hsdp"`, `x.name in ("fsdp", "hsdp")` and the like, with a strategy's name."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    names = set()
    for side in sides:
        if isinstance(side, ast.Constant) and isinstance(side.value, str):
            names.add(side.value)
        elif isinstance(side, (ast.Tuple, ast.List, ast.Set)):
            names |= {e.value for e in side.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return bool(names & STRATEGY_NAMES) and any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)


def test_only_the_strategies_compare_strategy_names():
    found = [f"{rel}:{node.lineno}" for rel, tree in _sources("trainer", "models")
             if not rel.startswith("trainer/strategies/") for node in ast.walk(tree) if _compares_a_strategy_name(node)]
    assert not found, f"strategy.name compared outside trainer/strategies/ (ask the strategy's capabilities): {found}"


def test_the_name_check_sees_a_comparison():
    assert _compares_a_strategy_name(ast.parse('cfg.strategy.name == "hsdp"', mode="eval").body)
    assert _compares_a_strategy_name(ast.parse('s.name in ("zero1", "zero2")', mode="eval").body)
    assert not _compares_a_strategy_name(ast.parse('cfg.optim.name == "adamw"', mode="eval").body)
