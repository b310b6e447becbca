#!/usr/bin/env python
"""Document-aware packing against padding on SFT data: the same model, examples and steps with data.packing=eos
(one example per padded sequence) and data.packing=documents (several examples per sequence, position ids
restarting, attention kept inside each).

    python benchmarks/bench_packing.py                        # alpaca_en_demo from ../shared/data, tiny preset
    python benchmarks/bench_packing.py --data my_sft.jsonl --seq-len 1024 --out /tmp/packing.json
    python benchmarks/bench_packing.py --quick --data alpaca.json   # debug-size model, few steps (the tests)

Per mode: target (response) tokens per step, target tokens/s (after warm-up), the share of sequence positions that
carry loss, and the speed-up of documents over eos in target tokens/s. See benchmarks/README.md.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

FULL = dict(model="tiny", precision="fp32", seq_len=512, global_batch=8, micro_batch=4, warmup=2, steps=30)
QUICK = dict(model="tiny", precision="fp32", seq_len=512, global_batch=4, micro_batch=2, warmup=1, steps=4)
SHARED_SFT = os.path.join(C.REPO, "..", "shared", "data", "datasets", "alpaca_en_demo.json")


def measure(a, packing: str, work: str) -> dict:
    overrides = [*C.shape_overrides(a), "strategy=single", "data=sft", f"data.path={a.data}", "data.val_fraction=0",
                 f"data.packing={packing}"]
    run = C.run_trainer(overrides, 1, os.path.join(work, packing), C.thread_env(a.threads), a.timeout)
    records = [r for r in run["metrics"] if "loss" in r]
    measured = [r for r in records if r["step"] > a.warmup]
    target_per_step = (measured[-1]["tokens"] - records[a.warmup - 1]["tokens"]) / len(measured)
    return {"packing": packing, "target_tokens_per_step": target_per_step,
            "loss_positions": target_per_step / (a.global_batch * a.seq_len),
            "target_tokens_per_s": C.tokens_per_s(run["metrics"], a.warmup), "final_loss": records[-1]["loss"]}


def main(argv=None) -> int:
    ap = C.shape_parser(__doc__, FULL, QUICK)
    ap.add_argument("--data", default=SHARED_SFT, help="SFT records (alpaca or chat JSON/JSONL; default "
                                                      "../shared/data/datasets/alpaca_en_demo.json)")
    a = C.finish_shape(ap, ap.parse_args(argv))
    if not os.path.exists(a.data):
        ap.error(f"--data {a.data} does not exist; pass SFT records with --data")
    a.data = os.path.abspath(a.data)
    work = tempfile.mkdtemp(prefix="tessera-packing-")
    try:
        rows = [measure(a, packing, work) for packing in ("eos", "documents")]
    except C.RunFailed as e:
        C.fail("bench_packing", str(e))
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    eos = rows[0]["target_tokens_per_s"]
    for r in rows:
        r["speedup"] = r["target_tokens_per_s"] / eos if eos else None
    print(C.markdown_table(
        ["packing", "target tokens / step", "positions with loss", "target tokens/s", "vs eos", "final loss"],
        [[r["packing"], f"{r['target_tokens_per_step']:.0f}", f"{r['loss_positions']:.1%}",
          f"{r['target_tokens_per_s']:.0f}", f"{r['speedup']:.2f}x" if r["speedup"] else "—",
          f"{r['final_loss']:.4f}"] for r in rows]))
    C.write_json(a.out, {"config": {k: getattr(a, k) for k in (*FULL, "threads", "set", "data")}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
