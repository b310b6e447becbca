"""What the README and docs/*.md show works: every relative link resolves (the file, and a `#anchor` to a heading
by GitHub's slug rules), and every command line in their code blocks that runs the trainer has overrides that
Hydra composes against the real conf/ (tests.conftest.compose_config), so a renamed key or group option fails here
instead of in a user's shell.

Commands recognised (after leading `NAME=value` environment assignments, with `\\`-continued lines joined):
`./launch.sh ...` (`./launch.sh plan ...` too; `./launch.sh test ...` takes pytest arguments, not overrides),
`python trainer/main.py ...`, `torchrun ... trainer/main.py ...`, `deepspeed ... trainer/main.py ...`,
`python -m trainer.torchrun ... trainer/main.py ...`, `python -m trainer.plan ...`, and `sbatch` / `srun` lines that
run launch.sh or trainer/main.py. Of their arguments, `key=value` / `group=option` tokens are composed (in a sweep,
`-m`, with the first of a `key=a,b` list's values); skipped are
launcher flags (`-...`), placeholders (`<...>`, `...`, `$VAR`) and `plan.*` (the planner strips plan.world_size and
plan.device_memory before composing). `hydra.*` overrides are left to Hydra's launcher, as compose_config does."""
from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from tests.conftest import REPO, compose_config


def documents() -> List[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---- Markdown: fences, headings, links ----------------------------------------------------------------------------
_FENCE = re.compile(r"^\s*(```|~~~)")


def split_fences(markdown: str) -> Tuple[List[Tuple[int, str]], List[Tuple[int, List[str]]]]:
    """(prose lines, code blocks): prose as (line number, text) outside fences; each fenced block as (line number
    of its first content line, its lines)."""
    prose, blocks, block, start, fence = [], [], None, 0, None
    for number, line in enumerate(markdown.splitlines(), 1):
        match = _FENCE.match(line)
        if block is None and match:
            block, start, fence = [], number + 1, match.group(1)
        elif block is not None and match and match.group(1) == fence:
            blocks.append((start, block))
            block = None
        elif block is not None:
            block.append(line)
        else:
            prose.append((number, line))
    return prose, blocks


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation but `-` and `_` dropped, spaces to
    hyphens (github-slugger)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set:
    """Every heading's anchor, repeats numbered as GitHub numbers them (`name`, `name-1`, ...)."""
    seen, result = {}, set()
    for _, line in split_fences(markdown)[0]:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(markdown: str) -> List[Tuple[int, str]]:
    """(line number, target) of every Markdown link in prose (code spans and fenced blocks are not links)."""
    found = []
    for number, line in split_fences(markdown)[0]:
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            found.append((number, target))
    return found


def broken_link(doc: Path, target: str) -> Optional[str]:
    """Why a relative link from `doc` does not resolve, or None when it does (or is not relative)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE):
        return None  # http:, https:, mailto:: not checked here
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    if not dest.exists():
        return f"{path} does not exist"
    try:
        dest.relative_to(REPO)
    except ValueError:
        return f"{path} is outside the repository"
    if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
        return f"{rel(dest)} has no heading with anchor #{anchor}"
    return None


DOCUMENT_LINKS = [(doc, number, target) for doc in documents() for number, target in links(doc.read_text())]


@pytest.mark.parametrize("doc,line,target", DOCUMENT_LINKS,
                         ids=[f"{rel(doc)}:{line}->{target}" for doc, line, target in DOCUMENT_LINKS])
def test_relative_link_resolves(doc: Path, line: int, target: str):
    problem = broken_link(doc, target)
    assert problem is None, f"{rel(doc)}:{line}: link ({target}): {problem}"


def test_the_guides_are_linked():
    assert len(DOCUMENT_LINKS) >= 20, "the link scanner found almost no links: is it still reading the guides?"
    linked = {(doc.parent / t.partition("#")[0]).resolve() for doc, _, t in DOCUMENT_LINKS if "#" != t[:1]}
    orphans = [rel(d) for d in documents()[1:] if d.resolve() not in linked]
    assert not orphans, f"guides no README or guide links to: {orphans}"


# ---- command lines ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str
    overrides: Tuple[str, ...]
    error: Optional[str] = None  # the line looks like a command but does not parse as a shell line

    @property
    def id(self) -> str:
        shown = " ".join(self.overrides) or "(no overrides)"
        return f"{rel(self.doc)}:{self.line} {shown[:70]}"


_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\$")


def logical_lines(block: List[str], start: int) -> List[Tuple[int, str]]:
    """The block's lines with `\\`-continuations joined (also inside quotes, as bash joins them)."""
    joined, current, first = [], "", None
    for offset, line in enumerate(block):
        first = start + offset if first is None else first
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1]
            continue
        joined.append((first, current + line))
        current, first = "", None
    if first is not None:
        joined.append((first, current))
    return joined


def trainer_arguments(tokens: List[str]) -> Optional[Tuple[str, List[str]]]:
    """("train" | "plan", the arguments that carry overrides) for a command that runs the trainer or the planner,
    else None."""
    while tokens and _ENV.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] in ("sbatch", "srun"):
        for i, token in enumerate(tokens[1:], 1):
            if token.endswith("launch.sh") or token.endswith("trainer/main.py"):
                rest = trainer_arguments(["./launch.sh", *tokens[i + 1:]]) if token.endswith("launch.sh") else None
                return rest or ("train", tokens[i + 1:])
        return None
    if tokens[0] == "./launch.sh":
        args = tokens[1:]
        if args[:1] == ["test"]:
            return None  # pytest arguments
        if args[:1] == ["plan"]:
            return "plan", args[1:]
        return "train", args
    if tokens[0] in ("python", "python3"):
        if tokens[1:2] == ["trainer/main.py"]:
            return "train", tokens[2:]
        if tokens[1:3] == ["-m", "trainer.plan"]:
            return "plan", tokens[3:]
        if tokens[1:3] != ["-m", "trainer.torchrun"]:
            return None
    elif tokens[0] not in ("torchrun", "deepspeed"):
        return None
    if "trainer/main.py" in tokens:
        return "train", tokens[tokens.index("trainer/main.py") + 1:]
    return None


def overrides_of(kind: str, args: List[str]) -> Tuple[str, ...]:
    sweep = "-m" in args or "--multirun" in args
    kept = []
    for token in args:
        if token.startswith("-") or "=" not in token or PLACEHOLDER.search(token):
            continue  # a launcher flag, a flag's value, or a placeholder
        if kind == "plan" and token.startswith("plan."):
            continue  # the planner's own keys, stripped before it composes
        key, _, value = token.partition("=")
        if sweep and "," in value and value[:1] not in "[{'\"":
            token = f"{key}={value.split(',')[0]}"  # a sweep's values (key=a,b): each job composes one
        kept.append(token)
    return tuple(kept)


def commands_in(doc: Path, markdown: Optional[str] = None) -> List[Command]:
    found = []
    for start, block in split_fences(doc.read_text() if markdown is None else markdown)[1]:
        for line, text in logical_lines(block, start):
            try:
                tokens = shlex.split(text, comments=True)
            except ValueError as err:  # prose in a block (a layout) or a broken command line
                words = [w for w in text.split() if not _ENV.match(w)]
                if words and (words[0] in COMMAND_WORDS or words[0].endswith("launch.sh")):
                    found.append(Command(doc, line, text.strip(), (), f"not a shell line: {err}"))
                continue
            parsed = trainer_arguments(tokens)
            if parsed is not None:
                found.append(Command(doc, line, text.strip(), overrides_of(*parsed)))
    return found


COMMAND_WORDS = ("./launch.sh", "python", "python3", "torchrun", "deepspeed", "sbatch", "srun")


def composition_problem(command: Command) -> Optional[str]:
    if command.error:
        return command.error
    try:
        compose_config(list(command.overrides))
    except Exception as err:  # Hydra's override, config-key and type errors all end here
        return f"{type(err).__name__}: {err}"
    return None


DOCUMENT_COMMANDS = [command for doc in documents() for command in commands_in(doc)]


def batches(commands: List[Command]) -> List[Tuple[str, ...]]:
    """Commands packed into few compositions (one Hydra compose costs about a second): a command joins the first
    batch in which none of its keys or groups has another value. Per command: the index of its batch."""
    packed: List[dict] = []
    where = []
    for command in commands:
        pairs = [token.split("=", 1) for token in command.overrides]
        for index, batch in enumerate(packed):
            if all(batch.get(key, value) == value for key, value in pairs):
                break
        else:
            index, batch = len(packed), {}
            packed.append(batch)
        batch.update(pairs)
        where.append(index)
    return [tuple(f"{k}={v}" for k, v in packed[i].items()) for i in where]


@functools.lru_cache(maxsize=None)
def cached_problem(overrides: Tuple[str, ...]) -> Optional[str]:
    return composition_problem(Command(REPO, 0, "", overrides))


@pytest.mark.parametrize("command,batch", list(zip(DOCUMENT_COMMANDS, batches(DOCUMENT_COMMANDS))),
                         ids=[c.id for c in DOCUMENT_COMMANDS])
def test_command_overrides_compose(command: Command, batch: Tuple[str, ...]):
    """A command whose batch composes composes alone (the schema is typed: a key's validity does not depend on
    the other overrides); where the batch fails, the command is composed alone to say which one is wrong."""
    if command.error is None and cached_problem(batch) is None:
        return
    problem = composition_problem(command)
    assert problem is None, (f"{rel(command.doc)}:{command.line}: `{command.text}`: its overrides "
                             f"{list(command.overrides)} do not compose with conf/: {problem}")


def test_the_commands_are_found():
    assert len(DOCUMENT_COMMANDS) >= 40, f"only {len(DOCUMENT_COMMANDS)} commands found: is the scanner still working?"
    assert any(c.doc.name == "README.md" for c in DOCUMENT_COMMANDS)


SAMPLE = """\
Text with a [good link](docs/config.md), a [bad one](docs/nope.md) and a [bad anchor](README.md#no-such-heading).

```bash
NPROC_PER_NODE=4 ./launch.sh strategy=ddp train.max_stepz=3      # a renamed key
./launch.sh test -n 0 tests/unit
./launch.sh plan strategy=fsdp plan.world_size=8 model.name_or_path=<dir>
torchrun --nnodes 1:4 --nproc_per_node 8 --rdzv-endpoint node0:29500 \\
  trainer/main.py strategy=hsdp "data.sources=[{name: a, path: $D/x}]" ...
python -m trainer.plan strategy=zero9
python -m trainer.export outputs/run /tmp/out
sbatch -N 2 launch.sh strategy=fsdp optim=adamw
```
"""


def test_the_scanners_catch_what_they_should():
    doc = REPO / "README.md"
    assert [broken_link(doc, t) is None for _, t in links(SAMPLE)] == [True, False, False]
    assert github_slug("Counting collective bytes: `logging.comm_bytes`") == "counting-collective-bytes-loggingcomm_bytes"
    assert github_slug("Continual training: a model in service, refreshed") == "continual-training-a-model-in-service-refreshed"
    found = [(c.line, c.overrides) for c in commands_in(doc, SAMPLE)]
    assert found == [(4, ("strategy=ddp", "train.max_stepz=3")), (6, ("strategy=fsdp",)), (7, ("strategy=hsdp",)),
                     (9, ("strategy=zero9",)), (11, ("strategy=fsdp", "optim=adamw"))]
    problems = {line: composition_problem(Command(doc, line, "", overrides)) for line, overrides in found}
    assert problems[4] and "max_stepz" in problems[4]  # a wrong key fails
    assert problems[9] and "zero9" in problems[9]  # so does a wrong group option
    assert problems[6] is None and problems[7] is None and problems[11] is None


def test_a_sweep_composes_its_first_values():
    assert overrides_of("train", ["-m", "optim.lr=1e-3,3e-4", "model.target_modules=[q,v]", "strategy=ddp"]) == (
        "optim.lr=1e-3", "model.target_modules=[q,v]", "strategy=ddp")
    assert overrides_of("train", ["optim.lr=1e-3,3e-4"]) == ("optim.lr=1e-3,3e-4",)  # not a sweep: as written
