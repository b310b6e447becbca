"""Documentation that cannot drift: every config key has a meaning in the schema, docs/config.md is what the
generator writes now, the README and docs/*.md name only files, folders, modules and config keys that exist, and
benchmarks/README.md only files, folders and modules that exist. No subprocesses; a few Hydra composes at most."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO, compose_config
from trainer.config import schema as C
from trainer.config import reference as R

# Folders at the repository root that documentation points into; a path starting with one must exist.
REPO_FOLDERS = ("trainer", "tests", "conf", "benchmarks", "models", "tessera", "docs")
# Names like `eval.jsonl` or `checkpoint.py` start with a section name but are files, not keys.
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "txt", "sh", "toml", "bin", "pt", "csv", "png"}

_PATH = re.compile(r"(?<![\w./~$<>-])((?:%s)/[\w./*-]*)" % "|".join(REPO_FOLDERS))
_MODULE = re.compile(r"python3? -m ((?:%s)(?:\.\w+)+)" % "|".join(REPO_FOLDERS))


def documentation_files():
    """README.md, benchmarks/README.md and docs/*.md."""
    return [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_of(markdown: str):
    """The text of fenced code blocks and inline code spans: where paths, commands and keys are named."""
    fences = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    return fences + re.findall(r"`([^`]+)`", prose)


def missing_paths(markdown: str):
    """Repository paths (trainer/..., conf/..., `python -m trainer.x`) named in code that do not exist.
    Placeholders (`tests/<name>.py`) are skipped; a glob must match something."""
    missing = []
    for code in code_of(markdown):
        for match in _PATH.finditer(code):
            path = match.group(1).rstrip(".")
            if code[match.end():match.end() + 1] in ("<", "{"):
                continue  # a placeholder follows: trainer/strategies/<name>.py
            found = any(REPO.glob(path.rstrip("/"))) if "*" in path else (REPO / path).exists()
            if not found:
                missing.append(path)
        for module in _MODULE.findall(code):
            base = REPO / module.replace(".", "/")
            if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                missing.append(f"python -m {module}")
    return sorted(set(missing))


def named_config_keys(markdown: str):
    """`section.key` names in code (`train.max_steps`, `data.path=...`, `+train.foo=1`) whose section is a schema
    section or `plan` (the planner's keys)."""
    sections = [group.name for group in fields(C.TesseraConfig)] + ["plan"]
    pattern = re.compile(r"(?<![\w./-])((?:%s)\.[A-Za-z_]\w*)(?![\w(/-])" % "|".join(sections))
    keys = set()
    for code in code_of(markdown):
        keys.update(key for key in pattern.findall(code) if key.rsplit(".", 1)[1] not in FILE_SUFFIXES)
    return keys


def known_keys():
    return {key for key, _ in C.schema_fields()} | set(R.PLANNER_KEYS)


def meaning_problems(schema) -> list:
    """One line per section or key of `schema` (a TesseraConfig-like dataclass) without a one-line meaning."""
    problems = []
    for group in fields(schema):
        if not group.metadata.get("help", "").strip():
            problems.append(f"section {group.name}: no meaning; declare it with section(Class, \"meaning\")")
        for spec in fields(group.default_factory):
            key, meaning = f"{group.name}.{spec.name}", spec.metadata.get("help", "")
            if not meaning.strip():
                problems.append(f"{key}: no one-line meaning; declare it with documented(default, \"meaning\")")
            elif "\n" in meaning or len(meaning) > 160:
                problems.append(f"{key}: the meaning must be one line of at most 160 characters (put the detail "
                                f"in a comment or the README)")
    return problems


def test_every_schema_key_has_a_one_line_meaning():
    problems = meaning_problems(C.TesseraConfig)
    assert not problems, "trainer/config/schema.py:\n" + "\n".join(problems)


def test_a_key_without_meaning_is_caught():
    @dataclass
    class Section:
        described: int = C.documented(1, "A key with its meaning.")
        bare: int = 2

    @dataclass
    class Schema:
        group: Section = C.section(Section, "A section.")

    assert meaning_problems(Schema) == ['group.bare: no one-line meaning; declare it with documented(default, '
                                        '"meaning")']


def test_config_reference_is_current():
    expected = R.render()
    current = R.DOC_PATH.read_text() if R.DOC_PATH.exists() else ""
    assert current == expected, (f"docs/config.md is stale (the schema, a check or conf/ changed); regenerate it "
                                 f"with `{R.REGENERATE}` and commit it")


@pytest.mark.parametrize("overrides", [[], ["model=hf", "strategy=zero3_offload"],
                                       ["experiment=alpaca_sft"], ["experiment=stories_shakespeare"]])
def test_reference_composes_like_hydra(overrides):
    """The generator merges conf/ itself (fast); these compositions hold it to what Hydra composes."""
    choices = dict(o.split("=", 1) for o in overrides)
    hydra = OmegaConf.to_container(compose_config(overrides, typed=False), resolve=True)
    assert R.compose(choices) == hydra


def test_reference_covers_every_key_and_group_option():
    text = R.DOC_PATH.read_text()
    for key, _ in C.schema_fields():
        assert f"| `{key}` |" in text, key
    assert len(R.group_options()) == sum(1 for _ in (REPO / "conf").glob("*/*.yaml"))


def test_planner_keys_are_the_planners():
    planner = (REPO / "trainer" / "planner" / "estimate.py").read_text()
    for key in R.PLANNER_KEYS:
        assert f'"{key}"' in planner, f"{key} is documented but trainer/planner/estimate.py does not read it"


@pytest.mark.parametrize("doc", documentation_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_documentation_names_existing_paths(doc: Path):
    if not doc.exists():
        pytest.skip(f"{doc.relative_to(REPO)} does not exist")
    missing = missing_paths(doc.read_text())
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def guide_files():
    """README.md and docs/*.md: where config keys are named (benchmarks/README.md names benchmark options)."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", guide_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_readme_names_existing_config_keys(doc: Path):
    unknown = sorted(named_config_keys(doc.read_text()) - known_keys())
    assert not unknown, (f"{doc.relative_to(REPO)} names config keys the schema (trainer/config/schema.py) does not "
                         f"have: {unknown}; see docs/config.md")


def test_the_scanners_catch_what_they_should():
    text = ("Run `python -m trainer.nope` and `trainer/gone.py` with `train.max_stepz=3`; fine: `trainer/config/schema.py`, "
            "`<run dir>/hf/`, `outputs/x/checkpoints/step_10`, `../shared/data/models`, `eval.jsonl`, "
            "`trainer/strategies/<name>.py`, `conf/*/*.yaml`.\n\n```bash\n./launch.sh data.pathh=/x model=hf\n```\n")
    assert missing_paths(text) == ["python -m trainer.nope", "trainer/gone.py"]
    assert named_config_keys(text) - known_keys() == {"train.max_stepz", "data.pathh"}
