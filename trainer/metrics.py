"""Throughput, MFU, memory, and the loggers: progress bar and console on rank 0, metrics.jsonl, TensorBoard."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Optional

import torch

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
    """Rank 0 writes; other ranks hold a logger that does nothing."""

    def __init__(self, run_dir: str, enabled: bool, max_steps: int, start_step: int, progress: bool,
                 tensorboard: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        self.jsonl = None
        if not enabled:
            return
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self.eval_jsonl = open(os.path.join(run_dir, "eval.jsonl"), "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.progress = progress
        self.max_steps = max_steps
        self.start_step = start_step
        self.t_start = time.perf_counter()

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
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])
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
        self.eval_jsonl.write(json.dumps({"step": step, **results}) + "\n")
        if step == 0:
            self.info(f"step 0 | val_loss {results['val_loss']:.4f} (ppl {results['val_ppl']:.2f})")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.eval_jsonl.close()


def format_record(r: dict) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"grad_norm {r['grad_norm']:.3f}",
             f"{r['tokens_per_s']:.0f} tok/s"]
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.2f})")
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
