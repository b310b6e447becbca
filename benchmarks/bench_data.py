#!/usr/bin/env python
"""Data at scale: training memory against corpus size, tokenization throughput against datasets.map, and the time to
the first step from a ready token store.

    python benchmarks/bench_data.py                      # a 64 MB generated corpus (x8 for the memory rows), 1/2/4 workers
    python benchmarks/bench_data.py --mb 1024 --workers 1,2,4,8 --out /tmp/data.json
    python benchmarks/bench_data.py --quick              # 1 MB, 1 and 2 workers (what the tests run)
    python benchmarks/bench_data.py --mb 64 --workers 1,2,4 --first-step-mb 1024   # the first step on a 1 GB corpus

Rows: (1) peak resident memory of a 2-step training run (strategy=single, debug-size model) on the plain-text corpus
at 1x and 8x its size, from data=text (tokenized inside the run), from data=tokens (a store) and from data=text with
data.streaming=true (read as training goes), with the ratio 8x/1x
(bounded memory: about 1); (2) tokens/s of `python -m trainer.tokenize --workers N` against
`datasets.load_dataset("text", sample_by="paragraph").map(tokenize, batched=True, num_proc=N)` with the same tokenizer
on the same file; (3) seconds to the first step of a 1-step run on the ready store of the 1x corpus. The corpus is
generated (random words, documents between blank lines), nothing is downloaded. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

WORDS = ("the of and to in is was he for it with as his on be at by had are but from or she an which you one we all "
         "were her would there their will when who him been has more if no out so said what up its about into than "
         "them can only other new some could time these two may then do first any my now such like our over man me "
         "even most made after also did many before must through back years where much your way well down").split()
TRAIN = [*C.DEBUG_MODEL, "strategy=single", "train.device=cpu", "data.seq_len=64", "train.global_batch_size=4",
         "train.micro_batch_size=2", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
         "checkpoint.at_end=false", "checkpoint.every=0", "logging.progress=false", "data.val_fraction=0.001"]


def write_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Documents of 20 to 2,000 random words between blank lines, written 1 MB at a time; returns bytes."""
    rng, target, written = random.Random(seed), int(megabytes * (1 << 20)), 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            chunk = "\n\n".join(" ".join(rng.choices(WORDS, k=rng.randint(20, 2000))) for _ in range(100)) + "\n\n"
            fh.write(chunk)
            written += len(chunk)
    return written


def replicate(src: str, dst: str, times: int) -> None:
    with open(dst, "wb") as out:
        for _ in range(times):
            with open(src, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 20)


MEASURE = ("import resource, subprocess, sys, time; t0 = time.time(); p = subprocess.run(sys.argv[1:], "
           "capture_output=True, text=True); print('RESULT', p.returncode, "
           "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.time() - t0); "
           "sys.stderr.write(p.stdout[-4000:] + p.stderr[-2000:])")


def measured(cmd: list, env: dict, timeout: float) -> dict:
    """Run `cmd` under a fresh helper process: its peak resident memory (MiB) and seconds."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=C.REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None or line.split()[1] != "0":
        raise C.RunFailed(f"{' '.join(map(str, cmd[:6]))} ...: {proc.stderr[-1500:]}")
    _, _, kib, seconds = line.split()
    done = re.search(r"done in ([0-9.]+)s", proc.stderr)
    return {"peak_rss_mib": int(kib) / 1024, "seconds": float(seconds),
            "job_seconds": float(done.group(1)) if done else float(seconds)}


def train_cmd(data: list, run_dir: str, steps: int = 2) -> list:
    return [sys.executable, os.path.join(C.REPO, "trainer", "main.py"), *TRAIN, f"train.max_steps={steps}", *data,
            f"hydra.run.dir={run_dir}"]


def tokenize_cmd(out: str, corpus: str, workers: int) -> list:
    return [sys.executable, "-m", "trainer.tokenize", out, "--workers", str(workers), "--shard-bytes",
            str(8 << 20), "data=text", f"data.path={corpus}"]


PEER = """
import sys, time, datasets
from models.tokenizer import embedded_tokenizer
datasets.disable_progress_bars()
tok = embedded_tokenizer()
ds = datasets.load_dataset("text", data_files=sys.argv[1], sample_by="paragraph", split="train",
                           cache_dir=sys.argv[3])
t0 = time.time()
out = ds.map(lambda b: tok(b["text"], add_special_tokens=False), batched=True, num_proc=int(sys.argv[2]) or None,
             remove_columns=["text"])
tokens = sum(len(x) for x in out["input_ids"])
print("PEER", tokens, time.time() - t0)
"""


def peer_tokens_per_s(corpus: str, workers: int, work: str, env: dict, timeout: float) -> float:
    """datasets.map(num_proc=N) with the same tokenizer; the Arrow conversion of the file is not timed."""
    proc = subprocess.run([sys.executable, "-c", PEER, corpus, str(workers if workers > 1 else 0),
                           os.path.join(work, f"hf-cache-{workers}")], cwd=C.REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PEER ")), None)
    if line is None:
        raise C.RunFailed(f"datasets.map: {proc.stderr[-1500:]}")
    _, tokens, seconds = line.split()
    return int(tokens) / float(seconds)


def memory_rows(corpus: str, big: str, work: str, env: dict, timeout: float) -> list:
    """Peak RSS of training from text, from a store and from the text streamed, at 1x and 8x the corpus."""
    rows = []
    for source in ("text", "tokens", "stream"):
        row = {"source": "data=text data.streaming=true" if source == "stream" else f"data={source}"}
        for size, path in (("1x", corpus), ("8x", big)):
            data = ["data=text", f"data.path={path}", f"data.cache_dir={work}/cache-{size}"]
            if source == "tokens":
                store = os.path.join(work, f"store-{size}")
                if not os.path.exists(store):
                    measured(tokenize_cmd(store, path, 1), env, timeout)
                data = ["data=tokens", f"data.path={store}"]
            if source == "stream":
                data = ["data=text", f"data.path={path}", "data.streaming=true"]
            row[size] = measured(train_cmd(data, os.path.join(work, f"run-{source}-{size}")), env, timeout)
        row["ratio"] = row["8x"]["peak_rss_mib"] / row["1x"]["peak_rss_mib"]
        rows.append(row)
    return rows


def tokenize_rows(corpus: str, workers: list, work: str, env: dict, timeout: float) -> list:
    rows = []
    for n in workers:
        out = os.path.join(work, f"tok-{n}")
        run = measured(tokenize_cmd(out, corpus, n), env, timeout)
        tokens = json.load(open(os.path.join(out, "manifest.json")))["num_tokens"]
        ours = tokens / run["job_seconds"]  # the job's own time ("done in"): the command's start-up left out
        peer = peer_tokens_per_s(corpus, n, work, env, timeout)
        rows.append({"workers": n, "tokens": tokens, "tessera_tokens_per_s": ours, "datasets_map_tokens_per_s": peer,
                     "ratio": ours / peer})
    return rows


def first_step(megabytes, store: str, workers: int, work: str, env: dict, timeout: float) -> dict:
    """Seconds to the first step of a 1-step run from a ready store: the 1x corpus's (`store`), or one of a corpus
    of `megabytes` written and tokenized here."""
    corpus_bytes = None
    if megabytes:
        corpus = os.path.join(work, "first-corpus.txt")
        corpus_bytes = write_corpus(corpus, megabytes, seed=1)
        store = os.path.join(work, "first-store")
        measured(tokenize_cmd(store, corpus, workers), env, timeout)
        os.remove(corpus)
    manifest = json.load(open(os.path.join(store, "manifest.json")))
    row = measured(train_cmd(["data=tokens", f"data.path={store}"], f"{work}/first", steps=1), env, timeout)
    row.update(tokens=manifest["num_tokens"], shards=len(manifest["shards"]),
               corpus_bytes=corpus_bytes or sum(f["bytes"] for f in manifest["source"]["files"]))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 MB, workers 1 and 2 (what the tests run)")
    ap.add_argument("--mb", type=float, help="corpus size in MB (default 64; --quick 1)")
    ap.add_argument("--workers", help="tokenizing processes to compare, comma-separated (default 1,2,4; --quick 1,2)")
    ap.add_argument("--first-step-mb", type=float,
                    help="corpus size in MB for the first-step row (default: --mb), tokenized with the most workers")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--out", help="write every figure as JSON here")
    a = ap.parse_args(argv)
    mb = a.mb or (1 if a.quick else 64)
    workers = [int(w) for w in (a.workers or ("1,2" if a.quick else "1,2,4")).split(",")]
    env = C.thread_env(1)
    work = tempfile.mkdtemp(prefix="tessera-data-")
    try:
        corpus, big = os.path.join(work, "corpus.txt"), os.path.join(work, "corpus-x8.txt")
        size = write_corpus(corpus, mb)
        replicate(corpus, big, 8)
        memory = memory_rows(corpus, big, work, env, a.timeout)
        tokenize = tokenize_rows(corpus, workers, work, env, a.timeout)
        first = first_step(a.first_step_mb, f"{work}/tok-{max(workers)}", max(workers), work, env, a.timeout)
    except C.RunFailed as e:
        C.fail("bench_data", str(e))
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus: {size / (1 << 20):.1f} MB generated text (8x: {8 * size / (1 << 20):.1f} MB)\n")
    print(C.markdown_table(["training from", "peak RSS 1x (MiB)", "peak RSS 8x (MiB)", "8x / 1x"],
                           [[r["source"], f"{r['1x']['peak_rss_mib']:.0f}", f"{r['8x']['peak_rss_mib']:.0f}",
                             f"{r['ratio']:.2f}"] for r in memory]))
    print()
    print(C.markdown_table(["workers", "trainer.tokenize tokens/s", "datasets.map tokens/s", "ratio"],
                           [[r["workers"], f"{r['tessera_tokens_per_s']:,.0f}", f"{r['datasets_map_tokens_per_s']:,.0f}",
                             f"{r['ratio']:.2f}"] for r in tokenize]))
    print(f"\nfirst step from a ready store of a {first['corpus_bytes'] / (1 << 20):.0f} MB corpus "
          f"({first['tokens']:,} tokens, {first['shards']} shards): {first['seconds']:.1f} s (a 1-step run, start-up "
          f"included; peak RSS {first['peak_rss_mib']:.0f} MiB)")
    C.write_json(a.out, {"corpus_bytes": size, "memory": memory, "tokenize": tokenize, "first_step": first})
    return 0


if __name__ == "__main__":
    sys.exit(main())
