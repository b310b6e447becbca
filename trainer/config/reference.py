"""Generates docs/config.md, the reference of every config key, from the typed schema in trainer/config/schema.py.

    python -m trainer.config_reference            # print the reference
    python -m trainer.config_reference --write    # rewrite docs/config.md
    python -m trainer.config_reference --check    # exit 1 when docs/config.md is stale

Each key's meaning is its field's `help` metadata; "allowed" comes from the checks in trainer/config/schema.py
(CHOICES, RANGES); the defaults are what conf/config.yaml's defaults compose to, and the "set by" column names
every conf/ option that changes a key. tests/unit/config/test_docs.py fails when docs/config.md is not this output.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from functools import lru_cache
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from trainer.config import schema as C

from trainer.config.compose import CONF_DIR, REPO
DOC_PATH = REPO / "docs" / "config.md"
REGENERATE = "python -m trainer.config_reference --write"

# Keys that only `python -m trainer.plan` reads (trainer/planner/estimate.py parses them itself; training refuses them).
PLANNER_KEYS = {
    "plan.world_size": "World size to plan for; default NPROC_PER_NODE x NNODES (1 for strategy=single).",
    "plan.device_memory": "GiB of one device: the plan says whether the run fits and lists the strategies "
                          "that do.",
}


# --- composing conf/ the way Hydra does, without Hydra (one Hydra compose takes ~0.1 s; the reference needs ~35) -

@lru_cache(maxsize=None)
def _load_option(group: str, option: str) -> Dict[str, Any]:
    path = CONF_DIR / group / f"{option}.yaml"
    text = path.read_text()
    body = OmegaConf.to_container(OmegaConf.load(path)) or {}
    package = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
    # Only the two shapes conf/ uses are emulated; anything else must fail here, not drift silently.
    if group == "experiment":
        if not package or package.group(1) != "_global_":
            raise ValueError(f"{path}: an experiment must be `# @package _global_`")
    elif package or "defaults" in body:
        raise ValueError(f"{path}: a @package directive or defaults list in a group option is not emulated by "
                         f"trainer/config/reference.py; teach it, or keep the option a plain list of keys")
    return body


def default_selection() -> Dict[str, Optional[str]]:
    """group -> option from conf/config.yaml's defaults list (experiment: None)."""
    selection = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            (group, option), = entry.items()
            if not group.startswith("override ") and not group.startswith("hydra"):
                selection[group] = option
    return selection


def compose(group_choices: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, Any]:
    """The config conf/config.yaml composes to with `group=option` choices, as a plain dict (hydra node left
    out). Groups merge in defaults-list order onto the schema; an experiment's `override /group: option`
    entries change the selection and its body is merged last (it comes after the groups)."""
    selection = {**default_selection(), **(group_choices or {})}
    experiment = selection.pop("experiment", None)
    experiment_body: Dict[str, Any] = {}
    if experiment:
        experiment_body = dict(_load_option("experiment", experiment))  # popped below; the cache keeps its own
        for entry in experiment_body.pop("defaults", []):
            (key, option), = entry.items()
            if not key.startswith("override /"):
                raise ValueError(f"conf/experiment/{experiment}.yaml: defaults entry {entry} is not emulated")
            selection[key[len("override /"):]] = option
    sections = [group.name for group in fields(C.TesseraConfig)]
    unknown = [name for name in list(selection) + list(experiment_body) if name not in sections]
    if unknown:
        raise ValueError(f"conf/ sets {unknown}, which are not sections of the schema")
    return {name: (_section(name, selection.get(name)) if name not in experiment_body else
                   _merged_section(name, selection.get(name), experiment_body[name])) for name in sections}


@lru_cache(maxsize=None)
def _section_schema(name: str) -> Any:
    return OmegaConf.structured(C.TesseraConfig.__dataclass_fields__[name].default_factory)


@lru_cache(maxsize=None)
def _section(name: str, option: Optional[str]) -> Dict[str, Any]:
    return _merged_section(name, option, None)


def _merged_section(name: str, option: Optional[str], extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """One section: the schema's defaults, the group option's file, then an experiment's values. A section at a
    time (never the whole config) because OmegaConf's merge copies everything it is given."""
    layers = [layer for layer in (_load_option(name, option) if option else None, extra) if layer]
    node = OmegaConf.merge(_section_schema(name), *layers) if layers else _section_schema(name)
    return OmegaConf.to_container(node, resolve=True)


def _lookup(cfg: Dict[str, Any], key: str) -> Any:
    group, name = key.split(".")
    return cfg[group][name]


def group_options() -> List[tuple]:
    """(group, option) for every option file under conf/, groups in the defaults list's order."""
    order = list(default_selection())
    groups = sorted((p.name for p in CONF_DIR.iterdir() if p.is_dir()),
                    key=lambda g: (order.index(g) if g in order else len(order), g))
    return [(g, p.stem) for g in groups for p in sorted((CONF_DIR / g).glob("*.yaml"))]


# --- rendering ----------------------------------------------------------------------------------------------------

def format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value != 0 and not 1e-4 <= abs(value) < 1e5:
        mantissa, exponent = f"{value:e}".split("e")
        short = f"{float(mantissa):g}e{int(exponent)}"  # 5e8 rather than 500000000.0
        return short if float(short) == value else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def format_type(annotation: str) -> str:
    """`Optional[List[int]]` -> `list[int] or null` (the schema's annotations are strings)."""
    optional = re.fullmatch(r"Optional\[(.*)\]", annotation)
    inner = optional.group(1) if optional else annotation
    inner = re.sub(r"List\[(.*)\]", r"list[\1]", inner)
    return inner + (" or null" if optional else "")


def allowed(key: str) -> str:
    if key in C.CHOICES:
        return "one of " + ", ".join(f"`{c}`" for c in C.CHOICES[key])
    if key in C.RANGES:
        return C.RANGES[key][1]
    if key in C.RANGE_CHECKED_ELSEWHERE:
        note = re.search(r"\((.*)\)$", C.RANGE_CHECKED_ELSEWHERE[key])
        return note.group(1) if note else ""
    return ""


def _cell(text: str) -> str:
    """Table-cell text: `|` would end the cell and `<run dir>` would vanish as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "\\<")


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _set_by(changes: Dict[str, Dict[str, List[str]]]) -> str:
    """{value: {group: [options]}} -> "`1`: strategy=3d, fsdp<br>`hf`: model=hf; experiment=alpaca_sft". Where
    several options of a group set the key to their own name (strategy=zero1 sets strategy.name to zero1), one
    entry says so."""
    def own_name_group(value: str, by_group: Dict[str, List[str]]) -> Optional[str]:
        return next(iter(by_group)) if len(by_group) == 1 and list(by_group.values())[0] == [value] else None

    own_names: Dict[str, List[str]] = {}
    for value, by_group in changes.items():
        group = own_name_group(value, by_group)
        if group:
            own_names.setdefault(group, []).append(value)
    parts = []
    for value, by_group in changes.items():
        group = own_name_group(value, by_group)
        if group and len(own_names[group]) > 1:
            if own_names[group][0] == value:
                parts.append(f"the option's name: {group}={', '.join(own_names[group])}")
            continue
        where = "; ".join(f"{g}={', '.join(options)}" for g, options in by_group.items())
        parts.append(f"{_code(value)}: {where}")
    return "<br>".join(parts)


def render() -> str:
    default = compose()
    changes: Dict[str, Dict[str, Dict[str, List[str]]]] = {}
    for group, option in group_options():
        variant = compose({group: option})
        for key, _ in C.schema_fields():
            value = _lookup(variant, key)
            if value != _lookup(default, key):
                by_value = changes.setdefault(key, {}).setdefault(format_value(value), {})
                by_value.setdefault(group, []).append(option)

    selection = ", ".join(f"{g}={o}" for g, o in default_selection().items() if o is not None)
    keys = C.schema_fields()
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from trainer/config/schema.py and conf/; do not edit by hand. -->",
        "",
        f"Every key of the typed schema (`trainer/config/schema.py`): {len(keys)} keys in "
        f"{len(fields(C.TesseraConfig))} sections. Set any of them with a Hydra override (`train.max_steps=50`); "
        "unknown keys fail. **default** is what `conf/config.yaml` composes to "
        f"({selection}); **set by** names the `conf/` options that change it (`model=hf`, "
        "`experiment=alpaca_sft`, ...), with the value they set; **allowed** is checked before any process group "
        "starts (all problems reported together). `python trainer/main.py --cfg job [overrides]` prints a "
        "resolved config.",
        "",
        "This file is generated from the schema: after changing a key, its meaning, a range or a `conf/` file, "
        f"run `{REGENERATE}` (`tests/unit/config/test_docs.py` fails until docs/config.md matches).",
        "",
        "Sections: " + ", ".join(f"[`{s.name}`](#{s.name})" for s in fields(C.TesseraConfig)) + ", "
        "[`plan`](#plan) (planner only).",
    ]
    for group in fields(C.TesseraConfig):
        lines += ["", f"## {group.name}", "", group.metadata["help"], "",
                  "| key | type | default | set by | allowed | meaning |", "|---|---|---|---|---|---|"]
        for key, spec in keys:
            if not key.startswith(group.name + "."):
                continue
            row = [f"`{key}`", _cell(format_type(spec.type)), _code(format_value(_lookup(default, key))),
                   _set_by(changes.get(key, {})), allowed(key).replace("|", "\\|"), _cell(spec.metadata["help"])]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## plan", "",
              "Read only by the preflight planner (`python -m trainer.plan`, `./launch.sh plan`), next to the "
              "training overrides; not part of the training schema.", "",
              "| key | meaning |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(meaning)} |" for key, meaning in PLANNER_KEYS.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.config_reference", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.relative_to(REPO)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/config.md differs from the output")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(exist_ok=True)
        DOC_PATH.write_text(text)
    elif args.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"docs/config.md is stale; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
