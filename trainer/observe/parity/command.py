"""`python -m trainer.parity <overrides> --against <overrides> [--steps N] [--out DIR] [--tolerance T]`: the same
config for N steps (default 10) under two settings (layout, launcher, world size or precision) on this machine, each
step's loss and gradient norm compared (docs/parity.md). The --against side starts from the first side's overrides.

Exit codes: 0 the runs agree within the tolerance, 5 they differ, 2 bad input (overrides that do not compose, sides
that train different batches or are the same run, a bad option), a side's own exit code when its run fails (2 bad
input, 3 diverged, 4 a fault), 4 a side that hangs past --timeout or a parity folder that cannot be written."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

from tessera.errors import TesseraError
from trainer.observe.parity.compare import Comparison, compare, tolerance_for
from trainer.observe.parity.runs import run_side
from trainer.observe.parity.shrink import shrink
from trainer.observe.parity.sides import LAUNCHERS, ParityError, Side, check_pair, forced, make_side
from trainer.observe.report.output import make_folder
from trainer.run.cli import debug_traceback, unwritable

EXIT_DIFFERS = 5  # parity only: both runs finished, and they differ by more than the tolerance


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every bad input of the project (argparse prints usage)
        print(f"error: {message} (python -m trainer.parity --help)", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m trainer.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides of side A (the reference)")
    p.add_argument("--against", nargs="*", required=True, metavar="OVERRIDE",
                   help="Hydra overrides of side B, applied on top of side A's (e.g. strategy=ddp, precision=bf16)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps of each run (default 10)")
    p.add_argument("--out", metavar="DIR", help="parity folder (default parity/<date>_<time>)")
    p.add_argument("--tolerance", type=float, help="relative tolerance (default: 1e-5 fp32; 3e-2 when a side "
                                                   "is bf16 or fp16)")
    for side, flag in (("A", ""), ("B", "against-")):
        p.add_argument(f"--{flag}nproc", type=int, metavar="N",
                       help=f"processes of side {side} (default: 1 for python, else NPROC_PER_NODE, the GPUs or 2)")
        p.add_argument(f"--{flag}launcher", choices=LAUNCHERS,
                       help=f"launcher of side {side} (default: launch.sh's choice for its strategy)")
    p.add_argument("--shrink", action="store_true", help="run a debug-size model of the same architecture "
                                                         "(model=hf: a shrunk copy with random weights); on by "
                                                         "itself when a side does not fit this machine")
    p.add_argument("--no-shrink", action="store_true", help="refuse (exit 2) instead of shrinking a model that "
                                                            "does not fit this machine")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one side may run (default 1800)")
    return p


def check_options(args) -> None:
    if args.steps < 1:
        raise ParityError(f"--steps must be at least 1, not {args.steps}")
    if args.tolerance is not None and not args.tolerance > 0:
        raise ParityError(f"--tolerance must be a positive relative difference (e.g. 1e-5), not {args.tolerance}")
    if not args.timeout > 0:
        raise ParityError(f"--timeout must be a positive number of seconds, not {args.timeout}")


def prepare(args) -> tuple:
    """The two sides, checked, and the parity folder (its a/ and b/ must be new: a run directory holding a run
    would be refused by the entry point, or appended to)."""
    check_options(args)
    a, cfg_a = make_side("A", args.overrides, args.launcher, args.nproc, args.steps)
    b, cfg_b = make_side("B", args.overrides + args.against, args.against_launcher, args.against_nproc, args.steps)
    b.against = list(args.against)
    check_pair(a, b, cfg_a, cfg_b)
    out_dir = os.path.abspath(args.out or os.path.join("parity", time.strftime("%Y-%m-%d_%H-%M-%S")))
    why = unwritable(out_dir)
    if why:
        raise ParityError(f"the parity folder {out_dir}: {why}; pass a writable --out DIR")
    for name in ("a", "b"):
        if os.path.isdir(os.path.join(out_dir, name)) and os.listdir(os.path.join(out_dir, name)):
            raise ParityError(f"{os.path.join(out_dir, name)} holds an earlier parity run; pass another --out DIR")
    make_folder(out_dir)
    return a, b, cfg_a, cfg_b, out_dir


def run(args) -> int:
    a, b, cfg_a, cfg_b, out_dir = prepare(args)
    # torch (the planner's estimate): after the options and sides are checked, so bad input ends in a second
    from trainer.observe.parity.fit import too_big

    notes: List[str] = [f"{args.steps} steps, every one logged; no evaluation, export or checkpoint"]
    extra = forced(args.steps)
    big = None if args.shrink else too_big([("A", cfg_a, a.nproc), ("B", cfg_b, b.nproc)])
    if big and args.no_shrink:
        raise ParityError(f"{big}; drop --no-shrink to compare a shrunk copy of the model")
    if big:
        notes.append(f"{big}: the model was shrunk")
        print(f"{big}: comparing a shrunk copy of the model (--no-shrink refuses instead)", flush=True)
    if args.shrink or big:
        shrunk, note = shrink(cfg_a, out_dir)
        extra, notes = extra + shrunk, notes + [note]
        print(note, flush=True)
    a.extra = b.extra = extra
    records_a = run_side(a, os.path.join(out_dir, "a"), args.timeout)
    records_b = run_side(b, os.path.join(out_dir, "b"), args.timeout)
    tolerance = args.tolerance or tolerance_for(a.precision, b.precision)
    comparison = compare(records_a, records_b, args.steps, tolerance)
    report(comparison, a, b, notes, out_dir)
    return 0 if comparison.passed else EXIT_DIFFERS


def report(comparison: Comparison, a: Side, b: Side, notes: List[str], out_dir: str) -> None:
    from trainer.observe.parity import output  # matplotlib: only once there is something to plot

    written = output.write_all(out_dir, comparison, a, b, notes)
    print("\n".join(output.table(comparison)))
    print(output.verdict(comparison, a, b))
    print(f"written: {', '.join(os.path.join(out_dir, name) for name in written)}")


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except TesseraError as e:
        debug_traceback()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
