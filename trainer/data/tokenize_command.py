"""`python -m trainer.tokenize OUT_DIR [--workers N] [--shard-range A:B] [--merge] [Hydra overrides]`: tokenize the
data that the same `model=` and `data=` overrides would train on into a sharded token store (trainer/data/shards.py),
which `data=tokens data.path=OUT_DIR` then trains from.

Exit codes: 0 written (or, with --shard-range, this range written), 2 bad input (an override that does not compose,
a data or model problem, a folder holding another source's store, shards missing at --merge), 4 the folder could
not be written (disk full, read-only)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Tuple

from models import registry
from tessera.errors import EXIT_BAD_INPUT, ConfigError
from trainer.config import schema as C
from trainer.config.compose import compose
from trainer.data.tokenizing import Job, run
from trainer.run.cli import COMPOSE_ERRORS, compose_message, exit_with, unwritable, user_errors


def _shard_range(text: str) -> Tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST:LAST (shard numbers, LAST excluded)") from None
    if not sep or a < 0 or b <= a:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST:LAST with 0 <= FIRST < LAST")
    return a, b


def parse(argv: List[str]):
    parser = argparse.ArgumentParser(prog="python -m trainer.tokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the token store's folder (created; resumed if there)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (the output is the same)")
    parser.add_argument("--shard-range", type=_shard_range, default=None, metavar="A:B",
                        help="write only shards A..B-1 of the plan (one range per machine)")
    parser.add_argument("--merge", action="store_true", help="write the manifest from the shards present")
    parser.add_argument("--shard-bytes", type=int, default=64 << 20, help="plain text per shard (bytes)")
    parser.add_argument("--shard-records", type=int, default=20_000, help="records per shard")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        parser.error(f"unrecognised arguments: {' '.join(bad)} (overrides are key=value)")
    if args.workers < 1 or args.shard_bytes < 1 or args.shard_records < 1:
        parser.error("--workers, --shard-bytes and --shard-records must be >= 1")
    return args, overrides


def main(argv=None) -> int:
    args, overrides = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = C.to_object(compose(overrides))
    except COMPOSE_ERRORS as e:
        exit_with(compose_message(e), EXIT_BAD_INPUT, same_on_every_rank=True)
    with user_errors():
        problems = [p for p in C.validate(cfg, 1) if p.startswith(("data.", "model."))]
        why = unwritable(args.out_dir)
        if why:
            problems.append(f"OUT_DIR {args.out_dir}: {why}")
        if problems:
            raise ConfigError(problems)
        tokenizer = registry.load_tokenizer(cfg.model)
        vocab_size = registry.describe(cfg.model, tokenizer).vocab_size
        job = Job(os.path.abspath(args.out_dir), args.workers, args.shard_range, args.merge, args.shard_bytes,
                  args.shard_records)
        t0 = time.time()
        manifest = run(job, cfg, tokenizer, vocab_size, log=lambda m: print(m, flush=True))
        if manifest is not None:
            seconds = time.time() - t0
            print(f"done in {seconds:.1f}s; train on it with data=tokens data.path={job.out_dir}", flush=True)
    return 0
