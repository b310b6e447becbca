"""`python -m trainer.report RUN_DIR [RUN_DIR ...] [--out DIR]`: several runs (or the runs below a folder, such as a
Hydra sweep) compared in one PNG figure per quantity and a Markdown table, report.md.

Default report folder: `<RUN_DIR>/report` for one argument (a run or a sweep), else `report/` in the deepest folder
that holds all the arguments. Exit codes: 0 written, 2 bad input (a path that is no run or holds none, a run file
that does not parse, matplotlib missing), 4 the report folder could not be written (disk full, read-only)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from tessera.errors import TesseraError
from trainer.observe.report import markdown, plots
from trainer.observe.report.output import make_folder, write_atomic
from trainer.observe.report.runs import ReportError, Run, find_runs, read_runs
from trainer.observe.report.summary import differing_overrides, summarize
from trainer.run.cli import debug_traceback, unwritable

REPORT = "report.md"


def default_out(paths: List[str]) -> str:
    """`<the argument>/report` for one argument, else `report/` in the deepest folder holding all of them."""
    absolute = [os.path.abspath(p) for p in paths]
    root = absolute[0] if len(absolute) == 1 else os.path.commonpath(absolute)
    return os.path.join(root, "report")


def write_report(runs: List[Run], out_dir: str) -> str:
    """The figures, then report.md naming them, into `out_dir`; returns report.md's table for the console."""
    make_folder(out_dir)
    written, skipped = plots.write_plots(runs, out_dir)
    summaries = [summarize(run) for run in runs]
    keys, overrides = differing_overrides(runs)
    text = markdown.render(runs, summaries, keys, overrides, out_dir, written, skipped)
    write_atomic(os.path.join(out_dir, REPORT), lambda fh: fh.write(text.encode()))
    table = markdown.table(runs, summaries, keys, overrides, out_dir)
    figures = ", ".join(p.file for p in written) or "none"
    notes = [f"skipped {p.file}: {p.missing}" for p in skipped]
    return "\n".join(table + [f"figures: {figures}", *notes])


def run(paths: List[str], out: Optional[str]) -> str:
    if not plots.available():
        raise ReportError("python -m trainer.report needs matplotlib: pip install 'tessera[report]' (or matplotlib)")
    runs = read_runs(find_runs(paths))
    out_dir = os.path.abspath(out or default_out(paths))
    why = unwritable(out_dir)
    if why:
        raise ReportError(f"the report folder {out_dir}: {why}; pass a writable --out DIR")
    console = write_report(runs, out_dir)
    return f"{console}\nreport of {len(runs)} run(s): {os.path.join(out_dir, REPORT)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run directory, or a folder of runs (a Hydra sweep directory)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where to write report.md and the figures (default: <RUN_DIR>/report for one "
                             "argument, else report/ in the deepest folder holding them all)")
    args = parser.parse_args(argv)
    try:
        print(run(args.run_dirs, args.out))
    except TesseraError as e:
        debug_traceback()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0
