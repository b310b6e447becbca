"""Shared plumbing of the benchmark scripts: run the trainer through its launcher and collect what it writes
(metrics.jsonl, memory.json, its log), the run-shape overrides, argument parsing, Markdown tables, JSON results,
and the baselines' common pieces (model and data as the trainer builds them, its AdamW, the HF Trainer run).

Run as a script, this file is the per-rank entry of a probed run (`launcher_command(..., script=PROBE)` with
TESSERA_BENCH_PROBE=<folder>): it runs trainer/main.py unchanged and times pipeline stages' compute in one step. Collective bytes are
the trainer's own count (comm_bytes in metrics.jsonl, trainer/observe/comm_bytes.py).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
PROBE = os.path.abspath(__file__)

# Every benchmark run: no eval, checkpoints, export, progress bar or TensorBoard; constant lr; a record per step.
QUIET = ["eval.every=0", "eval.at_start=false", "eval.at_end=false", "export.hf_at_end=false",
         "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none", "logging.progress=false",
         "logging.tensorboard=false", "scheduler=constant", "scheduler.warmup_steps=0", "train.log_every=1"]
# --quick: the tiny preset shrunk to a debug size (0.11M parameters): seconds of compute per run.
DEBUG_MODEL = ["model=tiny", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
               "model.num_kv_heads=2", "model.intermediate_size=128", "data.embedded_documents=400"]


class RunFailed(Exception):
    """A benchmark run that did not finish; the message has the command and the output's tail."""


def fail(script: str, message: str) -> None:
    print(f"{script}: {message}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------------------------
# Arguments shared by the scripts
# ---------------------------------------------------------------------------------------------------------------
def shape_parser(doc: str, full: dict, quick: dict) -> argparse.ArgumentParser:
    """The run-shape options every script has; `full` / `quick` are the defaults without / with --quick."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.set_defaults(full=full, quick_defaults=quick)
    ap.add_argument("--quick", action="store_true", help="debug-size model, few steps (what the tests run)")
    ap.add_argument("--model", help=f"preset in conf/model (default {full['model']}; --quick: a debug-size tiny)")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help=f"default {full['precision']}")
    ap.add_argument("--seq-len", type=int, help=f"default {full['seq_len']} (--quick {quick['seq_len']})")
    ap.add_argument("--global-batch", type=int, help=f"sequences per optimizer step (default {full['global_batch']})")
    ap.add_argument("--micro-batch", type=int, help=f"sequences per rank per forward (default {full['micro_batch']})")
    ap.add_argument("--warmup", type=int, help=f"steps not measured (default {full['warmup']})")
    ap.add_argument("--steps", type=int, help=f"measured steps (default {full['steps']})")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per process (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra Hydra override")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    ap.add_argument("--out", help="write every figure as JSON here")
    return ap


def finish_shape(ap: argparse.ArgumentParser, a) -> argparse.Namespace:
    """Fill the shape defaults and check them; bad values stop with one message (exit 2)."""
    defaults = a.quick_defaults if a.quick else a.full
    for key, value in defaults.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    if a.global_batch % a.micro_batch:
        ap.error("--global-batch must be a multiple of --micro-batch")
    return a


def shape_overrides(a) -> list:
    """Hydra overrides of the run shape (model, precision, batch, steps) plus QUIET and --set."""
    model = DEBUG_MODEL if a.quick and a.model == a.quick_defaults["model"] else [f"model={a.model}"]
    return [*model, f"precision={a.precision}", f"data.seq_len={a.seq_len}",
            f"train.global_batch_size={a.global_batch}", f"train.micro_batch_size={a.micro_batch}",
            f"train.max_steps={a.warmup + a.steps}", *QUIET, *a.set]


def compose(overrides) -> object:
    """The trainer's config (a dataclass tree) for these overrides, composed as the trainer's commands do."""
    from hydra.core.global_hydra import GlobalHydra

    from trainer.config.compose import compose as compose_conf
    from trainer.config.schema import to_object

    GlobalHydra.instance().clear()
    return to_object(compose_conf(overrides))


def model_counts(overrides, seq_len: int) -> dict:
    """Parameters of the model these overrides build (its Hugging Face config on the meta device) and its training
    FLOPs per token, as the trainer's MFU counts them (6N + 12·L·d·T, N without the input embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import registry
    from trainer.observe.metrics import flops_per_token

    cfg = compose(overrides)
    info = registry.describe(cfg.model, registry.load_tokenizer(cfg.model))
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(info.hf_config).parameters())
    c = info.hf_config
    without_embedding = total - c.vocab_size * c.hidden_size  # as trainer/run/loop.py counts
    return {"params": total, "params_without_input_embedding": without_embedding, "layers": c.num_hidden_layers,
            "hidden": c.hidden_size,
            "flops_per_token": flops_per_token(without_embedding, c.num_hidden_layers, c.hidden_size, seq_len)}


def known_peak_tflops() -> Optional[float]:
    """Dense bf16 peak of the local GPU from trainer/observe/metrics.py KNOWN_PEAKS (None without a known GPU)."""
    import torch

    from trainer.observe.metrics import KNOWN_PEAKS

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((p for key, p in KNOWN_PEAKS if key in name), None)


def thread_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


# ---------------------------------------------------------------------------------------------------------------
# The baselines' shared pieces (bench_throughput.py, bench_backends.py)
# ---------------------------------------------------------------------------------------------------------------
def build_model_and_data(spec) -> tuple:
    """(config, seeded model, training sequences) for spec["overrides"], built as the trainer builds them (the
    same seed, the same sequences), with spec["threads"] torch threads."""
    import torch

    from models import registry
    from trainer.data.datasets import build_data

    torch.set_num_threads(spec["threads"])
    cfg = compose(spec["overrides"])
    tokenizer = registry.load_tokenizer(cfg.model)
    info = registry.describe(cfg.model, tokenizer)
    model = registry.build(cfg.model, info, cfg.train.seed)
    return cfg, model, build_data(cfg, tokenizer, info.vocab_size, log=lambda msg: None).train


def global_batch_indices(cfg, train) -> list:
    """Sequence indices of the first global batches (at most 4), which every baseline cycles through."""
    gbs = cfg.train.global_batch_size
    return [list(range(b * gbs, (b + 1) * gbs)) for b in range(max(1, min(4, len(train) // gbs)))]


def train_device(cfg):
    """Where the trainer would run this rank: its local GPU, unless there is none or train.device=cpu."""
    import torch

    if torch.cuda.is_available() and cfg.train.device != "cpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def adamw(cfg, model):
    """The trainer's AdamW for `model`: the config's hyper-parameters and kernel, weight decay on matrices only."""
    import torch

    from trainer.run.optim import implementation_kwargs

    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    kernel = implementation_kwargs(o.implementation, decay + rest, o.name)
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             **kernel)


def hf_train(cfg, model, train, work: str, check=None, **extra) -> list:
    """transformers.Trainer on `model` over the first global batches' sequences in order (labels already
    shifted: passed as `shift_labels`, so HF's loss covers the same targets); AdamW with the config's lr, betas,
    eps, weight decay and kernel, clipping at train.grad_clip, constant lr, no eval, saving or progress bar.
    The global batch is micro batch x WORLD_SIZE x accumulation. `extra`: more TrainingArguments (the row's
    distributed settings); `check(trainer)` runs before training. Returns this rank's wall time at the end of
    every optimizer step."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainer.run.optim import implementation_kwargs

    o, t = cfg.optim, cfg.train
    cuda = train_device(cfg).type == "cuda"
    fused = implementation_kwargs(o.implementation, list(model.parameters()), o.name).get("fused")
    rows = [{"input_ids": b["input_ids"][i], "labels": b["labels"][i], "shift_labels": b["labels"][i]}
            for b in map(train.get, global_batch_indices(cfg, train)) for i in range(len(b["input_ids"]))]
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=work, per_device_train_batch_size=t.micro_batch_size, max_steps=t.max_steps,
        gradient_accumulation_steps=t.global_batch_size // (t.micro_batch_size * int(os.environ.get("WORLD_SIZE", 1))),
        learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        adam_epsilon=o.eps, max_grad_norm=t.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused" if fused else "adamw_torch", bf16=cfg.precision.name == "bf16",
        fp16=cfg.precision.name == "fp16", use_cpu=not cuda, save_strategy="no", report_to=[],
        logging_steps=t.max_steps, disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0,
        train_sampling_strategy="sequential", seed=t.seed, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepEnds()])
    if check:
        check(trainer)
    trainer.train()
    return ends


# ---------------------------------------------------------------------------------------------------------------
# Running the trainer
# ---------------------------------------------------------------------------------------------------------------
def run_trainer(overrides, nproc: int, run_dir: str, env: dict, timeout: float, probe: bool = False) -> dict:
    """One training run of trainer/main.py on `nproc` local processes through the launcher launch.sh would
    pick for these overrides. Returns its metrics.jsonl records, memory.json (or None), each rank's probe
    file (probe=True), its output and `launch_time` (time.time() just before the launcher started)."""
    from trainer.launch.choose import launcher_command, launcher_for, run_process_group

    launcher = launcher_for(overrides)
    if launcher == "torchrun":
        launcher = "torchrun-quiet"
    if launcher == "python" and nproc != 1:
        raise RunFailed(f"this strategy runs as one process, not {nproc}")
    env = dict(env)
    if probe:
        env["TESSERA_BENCH_PROBE"] = run_dir
    cmd = [*launcher_command(launcher, nproc, script=PROBE if probe else _main()),
           *overrides, f"hydra.run.dir={run_dir}"]
    launch_time = time.time()
    done = run_process_group(cmd, env=env, timeout=timeout)
    output = done.stdout + done.stderr
    with open(os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".log"), "w") as fh:
        fh.write(" ".join(cmd) + "\n" + output)
    if done.returncode != 0:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-6:]
        raise RunFailed(f"exit {done.returncode}: " + " | ".join(tail))
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    memory_path = os.path.join(run_dir, "memory.json")
    memory = json.load(open(memory_path)) if os.path.exists(memory_path) else None
    probes = []
    for rank in range(nproc if probe else 0):
        path = os.path.join(run_dir, f"probe-rank{rank}.json")
        probes.append(json.load(open(path)) if os.path.exists(path) else None)
    return {"metrics": metrics, "memory": memory, "probes": probes, "output": output,
            "launch_time": launch_time, "seconds": done.seconds, "launcher": launcher}


def _main() -> str:
    from trainer.launch.choose import MAIN

    return MAIN


def read_jsonl(path: str) -> list:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def tokens_per_s(records, warmup: int) -> float:
    """Target tokens of the logged steps after `warmup` over their summed step time (records of one step each:
    train.log_every=1; the time a record covers is its tokens / tokens_per_s)."""
    tokens, seconds, before = 0, 0.0, {r["step"]: r["tokens"] for r in records}
    for r in records:
        if r["step"] > warmup and r["tokens_per_s"] > 0:
            n = r["tokens"] - before.get(r["step"] - 1, 0)
            tokens, seconds = tokens + n, seconds + n / r["tokens_per_s"]
    return tokens / seconds if seconds else 0.0


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------
def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path, result) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {path}")


def mib(n) -> str:
    return f"{n / 2**20:.2f}" if n is not None else "—"


# ---------------------------------------------------------------------------------------------------------------
# The probe (inside every rank of a probed run)
# ---------------------------------------------------------------------------------------------------------------
class Probe:
    """Times the pipeline stages' compute in step `profile_step` and writes <run dir>/probe-rank<R>.json at exit
    (collective bytes come from the trainer itself: comm_bytes in metrics.jsonl)."""

    def __init__(self, out_dir: str, profile_step: int):
        self.out_dir, self.profile_step = out_dir, profile_step
        self.rank = int(os.environ.get("RANK", "0"))
        self.spans, self.profile = None, None
        if profile_step:
            self._time_pipeline_compute()

    def _time_pipeline_compute(self) -> None:
        # Schedule1F1B marks no profiler ranges (only GPipe and the multi-stage runtime do), so the stage's own
        # compute entry points are timed: forward, backward (input and weight parts) of one micro-batch. They are
        # shadowed on the public PipelineStage class, the one the trainer builds its stages from.
        from torch.distributed.pipelining import PipelineStage

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            def timed(self_, *args, _original=getattr(PipelineStage, name), **kwargs):
                t0 = time.time()
                try:
                    return _original(self_, *args, **kwargs)
                finally:
                    if self.spans is not None:
                        self.spans.append((t0, time.time()))
            setattr(PipelineStage, name, timed)

    def after_step(self, step: int) -> None:
        if self.spans is not None:
            spans, self.spans = self.spans, None
            self.profile = {"compute_start": min((a for a, _ in spans), default=None),
                            "compute_end": max((b for _, b in spans), default=None),
                            "compute_busy_s": _union_length(spans), "compute_calls": len(spans)}
        if step + 1 == self.profile_step:
            self.spans = []

    def dump(self) -> None:
        with open(os.path.join(self.out_dir, f"probe-rank{self.rank}.json"), "w") as fh:
            json.dump({"rank": self.rank, "profile": self.profile}, fh)


def _union_length(spans) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def probe_main() -> None:
    """Per-rank entry of a probed run: install the probe, then run trainer/main.py with this rank's arguments."""
    import runpy

    from trainer.observe.metrics import MetricsLogger

    out_dir = os.environ["TESSERA_BENCH_PROBE"]
    probe = Probe(out_dir, profile_step=int(os.environ.get("TESSERA_BENCH_PROFILE_STEP", "0")))
    advance = MetricsLogger.advance

    def advance_and_probe(self, step, record):
        advance(self, step, record)
        probe.after_step(step)

    MetricsLogger.advance = advance_and_probe
    atexit.register(lambda: os.path.isdir(out_dir) and probe.dump())
    main = _main()
    sys.argv = [main, *sys.argv[1:]]
    runpy.run_path(main, run_name="__main__")


if __name__ == "__main__":
    probe_main()
