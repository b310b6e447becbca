"""Throughput, MFU, memory, and the loggers: progress bar and console on rank 0, metrics.jsonl, TensorBoard, and the
experiment trackers (trainer/observe/trackers.py), which get every record from here."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Optional

import torch

from tessera.errors import FaultError, one_line
from trainer.objectives.preference import METHODS as PREFERENCE_METHODS
from trainer.observe.trackers import Trackers

# Dense bf16 peak TFLOP/s of one device, by a substring of its name.
KNOWN_PEAKS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 125.0),
               ("4090", 165.0))


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12*L*d*T for attention (N without the input
    embedding, which is a lookup, not a matmul)."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len


def device_peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in KNOWN_PEAKS:
            if key in name:
                return peak
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated on CUDA; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing. Every record also goes to the run's experiment
    trackers (`trackers`, none by default), which the logger starts, feeds and finishes."""

    def __init__(self, run_dir: str, enabled: bool, max_steps: int, start_step: int, progress: bool,
                 tensorboard: bool, trackers: Optional[Trackers] = None):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        self.jsonl = None
        self.eval_jsonl = None
        self.tensorboard = tensorboard
        self.run_dir = run_dir
        self.start_step = start_step
        self.trackers = trackers if trackers is not None else Trackers()
        self.final: dict = {}  # the trackers' final summary: the last loss, validation loss, tokens and step
        if not enabled:
            return
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.eval_path = os.path.join(run_dir, "eval.jsonl")
        self.jsonl = _open_log(self.metrics_path)
        self.eval_jsonl = _open_log(self.eval_path)
        self.progress = progress
        self.max_steps = max_steps
        self.t_start = time.perf_counter()

    def resume(self, step: int) -> None:
        """A run continued from step `step` (0: started over by checkpoint.resume=auto without a checkpoint):
        drop what a killed attempt logged after it (and lines a crash cut short), so each log stays one series.
        The evaluation at step 0 is made again when starting over, so it goes too."""
        self.start_step = step
        if not self.enabled:
            return
        self.jsonl.close()
        self.eval_jsonl.close()
        truncate_jsonl(self.metrics_path, lambda s: s <= step)
        truncate_jsonl(self.eval_path, lambda s: s < step or (s == step and step > 0))
        self.jsonl = _open_log(self.metrics_path)
        self.eval_jsonl = _open_log(self.eval_path)

    def _tb(self):
        if self.tb is None and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run discards the events a killed attempt wrote after its checkpoint.
            purge = self.start_step + 1 if self.start_step > 0 else None
            self.tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"), purge_step=purge)
        return self.tb

    def _ensure_bar(self):
        # A live bar on a terminal; plain lines (with ETA) when output goes to a file or a pipe.
        if self.bar is None and self.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.max_steps, initial=self.start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def advance(self, step: int, record: Optional[dict]) -> None:
        """Called every step; `record` is set on steps that log."""
        if not self.enabled:
            return
        self._ensure_bar()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if record is None:
            return
        _write(self.jsonl, self.metrics_path, record)
        self._track(record)
        tb = self._tb()
        if tb is not None:
            for k, v in _scalars(record):
                tb.add_scalar(k, v, record["step"])
        if self.bar is not None:
            post = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                    "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "val_loss" in record:
                post["val"] = f"{record['val_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)
        else:
            elapsed = time.perf_counter() - self.t_start
            done = max(step - self.start_step, 1)
            eta = elapsed / done * (self.max_steps - step)
            self.info(f"{format_record(record)} | {step}/{self.max_steps} ETA {_hms(eta)}")

    def eval_record(self, step: int, results: dict) -> None:
        """Every evaluation, also the one before training (step 0), in eval.jsonl."""
        if not self.enabled or not results:
            return
        _write(self.eval_jsonl, self.eval_path, {"step": step, **results})
        self.trackers.log_eval(step, dict(_scalars(results)))
        if "val_loss" in results:
            self.final["final/val_loss"] = results["val_loss"]
        if step == 0:
            self.info(f"step 0 | val_loss {results['val_loss']:.4f} (ppl {results['val_ppl']:.2f})")

    def start_trackers(self, step: int, continues: bool, checkpoint: Optional[str]) -> None:
        """Open the trackers' runs once the run's step is known (trainer/observe/trackers.py: which run, what is
        skipped): `continues`, this launch continues its run directory; `checkpoint`, the one it resumed fully."""
        if self.enabled:
            self.trackers.say = self.info
            self.trackers.start(step, continues, checkpoint)

    def _track(self, record: dict) -> None:
        """A metrics record to the trackers, and what the final summary takes from it."""
        self.trackers.log_metrics(record["step"], dict(_scalars(record)))
        self.final.update({"final/loss": record["loss"], "final/tokens": record.get("tokens"),
                           "final/steps": record["step"]})  # final/val_loss: eval_record

    def checkpoint_saved(self, step: int, path: str) -> None:
        """A checkpoint is complete (rank 0): its path to the trackers."""
        if self.enabled:
            self.trackers.note({f"checkpoint/step_{step}": path, "checkpoint/latest": path})

    def exported(self, folders) -> None:
        """The exported folders (hf/, hf-adapter/): their paths to the trackers."""
        if self.enabled:
            self.trackers.note({f"export/{os.path.basename(os.path.normpath(f))}": f for f in folders})

    def close(self, ok: bool = True) -> None:
        """Close the logs; the trackers get the final summary and end their runs (failed, unless `ok`)."""
        if self.enabled:
            summary = dict(_scalars({k: v for k, v in self.final.items() if v is not None}))
            self.trackers.finish(summary, int(self.final.get("final/steps", self.start_step)), ok)
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        for fh in (self.jsonl, self.eval_jsonl):
            if fh is not None:
                try:
                    fh.close()
                except OSError:  # a failed write was already reported
                    pass


def finite_or_none(obj):
    """NaN and infinities become None (JSON null), in nested dicts and lists too."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def json_line(record: dict) -> str:
    """One line of valid JSON (never a bare NaN or Infinity)."""
    return json.dumps(finite_or_none(record), allow_nan=False) + "\n"


def _log_fault(path: str, e: OSError) -> FaultError:
    return FaultError(f"writing {path} failed: {e.strerror or one_line(e)}; the disk is full or the folder is not "
                      f"writable. Free space (or fix the permissions), then continue with checkpoint.resume=auto")


def _open_log(path: str):
    try:
        return open(path, "a", buffering=1)
    except OSError as e:
        raise _log_fault(path, e) from None


def _write(fh, path: str, record: dict) -> None:
    try:
        fh.write(json_line(record))
    except OSError as e:
        raise _log_fault(path, e) from None


def truncate_jsonl(path: str, keep) -> int:
    """Rewrite a JSONL log (atomically) keeping the records whose `step` passes `keep`, in order, and dropping
    lines that do not parse (the last one, cut short by a crash); returns how many lines were dropped."""
    try:
        with open(path, "rb") as fh:
            lines = fh.read().split(b"\n")
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise FaultError(f"reading {path} failed: {e.strerror or one_line(e)}") from None
    kept, dropped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("step"), int) and keep(rec["step"])
        except ValueError:
            ok = False
        if ok:
            kept.append(line)
        else:
            dropped += 1
    if dropped == 0 and (not lines or lines[-1] == b""):
        return 0  # nothing to drop, and the file ends with a newline: leave it as it is
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(b"".join(line + b"\n" for line in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise _log_fault(path, e) from None
    return dropped


def format_record(r: dict) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"grad_norm {r['grad_norm']:.3f}",
             f"{r['tokens_per_s']:.0f} tok/s"]
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f}" + (f" (ppl {r['val_ppl']:.2f})" if "val_ppl" in r else ""))
    for key in PREFERENCE_METHODS:  # a preference objective's rewards (trainer/objectives/objective.py)
        if key in r:
            parts.append(f"margin {r[key]['margin']:.3f} acc {r[key]['accuracy']:.2f}")
    return " | ".join(parts)


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Throughput:
    """Tokens per second over the window since the last logged step."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.seq_tokens = 0

    def add(self, tokens: int, seq_tokens: int) -> None:
        self.tokens += tokens
        self.seq_tokens += seq_tokens

    def exclude(self, seconds: float) -> None:
        """Leave out time that was not training (evaluation, checkpointing)."""
        self.t0 += seconds

    def take(self):
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        out = (self.tokens / dt, self.seq_tokens / dt)
        self.t0, self.tokens, self.seq_tokens = now, 0, 0
        return out


def _scalars(record: dict, prefix: str = ""):
    """(name, value) of the finite numbers in a record, nested ones (per-task figures) as "tasks/name/loss"."""
    for k, v in record.items():
        if isinstance(v, dict):
            yield from _scalars(v, f"{prefix}{k}/")
        elif k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            yield prefix + k, v
