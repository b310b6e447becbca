"""The strategy-agnostic training and evaluation loop.

Per optimizer step: the global batch comes from the sampler, its target-token count is read from the data
(every rank can, so no collective is needed for it), this rank's slice is cut into micro-batches, and the
strategy runs forward/backward and the optimizer step. The loop never asks which strategy it runs.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from trainer.observe import comm_bytes
from trainer.data.datasets import IGNORE
from trainer.resilience.divergence import DivergenceGuard
from trainer.observe.memory import FirstStepProbe, write_report
from trainer.observe.metrics import Throughput, device_peak_tflops, flops_per_token, peak_memory_gib


def fit(run) -> None:
    cfg, strategy = run.cfg, run.strategy
    t = cfg.train
    throughput = Throughput()
    info = run.model_info
    embed_params = info.vocab_size * info.hidden_size
    flops_tok = flops_per_token(run.num_params - embed_params, info.num_layers, info.hidden_size, cfg.data.seq_len)
    peak = device_peak_tflops(run.device, cfg.logging.peak_tflops)
    if cfg.eval.at_start and run.step == 0:
        results = evaluate(run)
        if results:  # data.follow has no validation split
            run.logger.eval_record(0, results)
    strategy.model.train()
    # logging.memory_report: probe the first step's model-state memory (trainer/observe/memory.py)
    probe = FirstStepProbe(strategy) if cfg.logging.memory_report else None
    guard = DivergenceGuard(run)
    comm = comm_bytes.COUNTER
    started = time.monotonic()
    while run.step < t.max_steps:
        strategy.begin_step(run.step)  # a replica group that recovers from a peer may move run.step here
        k = run.step
        if k >= t.max_steps:
            break
        global_batch = run.sampler.global_batch(k)
        if global_batch is None:  # data.follow: a stop signal, or no new record for its idle limit, while waiting
            run.stopped_by = run.stop.name
            break
        n_target = run.data.train.count_targets(global_batch)
        positions = run.sampler.micro_batches(k, strategy.dp_rank, strategy.dp_size, t.micro_batch_size)
        micro_batches = [run.data.train.get(pos) for pos in positions]
        lr = strategy.optimizer.param_groups[0]["lr"]
        with comm.window():  # the step's collectives: comm_bytes
            loss_sum = strategy.forward_backward(micro_batches, n_target)
            grad_norm, skipped = strategy.optimizer_step(t.grad_clip)
        if not strategy.committed():  # not taken (a replica group failed during it; the strategy says so): again
            continue
        run.scheduler.step()
        run.step += 1
        n_target = strategy.trained_tokens(n_target)
        run.tokens_seen += n_target
        run.skipped_steps += int(skipped)
        run.watchdog.finished_step(run.step)
        guard.observe(run.step, grad_norm, skipped)
        throughput.add(n_target, len(global_batch) * cfg.data.seq_len)

        periodic_eval = cfg.eval.every > 0 and run.step % cfg.eval.every == 0
        do_eval = periodic_eval or (run.step == t.max_steps and cfg.eval.at_end)
        if run.step % t.log_every == 0 or run.step == t.max_steps or do_eval:
            loss = strategy.step_loss(loss_sum, n_target)
            tok_s, seq_tok_s = throughput.take()
            record = {"step": run.step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                      "tokens": run.tokens_seen, "tokens_per_s": tok_s, "seq_tokens_per_s": seq_tok_s,
                      "epoch": run.sampler.epoch_of(k), "skipped_steps": run.skipped_steps,
                      "peak_mem_gib": peak_memory_gib(run.device), "time": round(time.time(), 3)}
            record.update(strategy.step_metrics())
            task_sums = strategy.task_sums()  # data.kind=mixture: each task's loss and target tokens
            if task_sums is not None:
                record["tasks"] = {name: {"loss": float(s / n) if n else None, "tokens": int(n)}
                                   for name, (s, n) in zip(run.data.tasks, task_sums.tolist())}
            if strategy.counts_all_collectives:
                record.update(comm.take() or {})
            if strategy.precision.loss_scale is not None:
                record["loss_scale"] = strategy.precision.loss_scale
            if peak:
                record["mfu"] = seq_tok_s * flops_tok / (peak * 1e12 * run.strategy.dims.world_size)
            if do_eval:
                t_eval = time.perf_counter()
                with run.watchdog.exempt("evaluation"):
                    results = evaluate(run)
                record.update(results)
                if results:
                    run.logger.eval_record(run.step, results)
                throughput.exclude(time.perf_counter() - t_eval)
        else:
            record = None
        run.logger.advance(run.step, record)
        if record is not None:
            guard.check_logged(run.step, record["loss"], skipped)  # after the record is logged: it shows the value
        if probe is not None:  # all ranks: gather, log one line, write memory.json (left out of tokens/s)
            t_aside = time.perf_counter()
            with run.watchdog.exempt("memory report"):
                write_report(run, probe)
            probe = None
            throughput.exclude(time.perf_counter() - t_aside)

        run.checkpointer.poll()
        if t.max_time_s and time.monotonic() - started >= t.max_time_s:
            run.stop.request("train.max_time_s")  # agreed below: any rank past the limit stops them all
        if run.stop.agreed():
            run.stopped_by = run.stop.name
            what = run.stopped_by if run.stop.reason else f"{run.stopped_by} received"
            run.logger.info(f"{what}: stopping after step {run.step}")
            break
        t_aside = time.perf_counter()
        if run.checkpointer.due(run.step):
            guard.check(run.step)  # only finite weights are ever saved
        with run.watchdog.exempt("checkpoint save"):
            run.checkpointer.maybe_save(run.step)  # a save's wait is reported by the checkpointer, not in tokens/s
        if run.snapshots.due(run.step):  # export.snapshot_every: a served model follows the training
            guard.check(run.step)
            with run.watchdog.exempt("snapshot"):
                strategy.export_hf(run.snapshots.folder(run.step), run.tokenizer)
                run.snapshots.publish(run.step)
        throughput.exclude(time.perf_counter() - t_aside)
    guard.check(run.step)
    with run.watchdog.exempt("checkpoint save"):
        if cfg.checkpoint.at_end or run.stopped_by:
            run.checkpointer.save(run.step)
        run.checkpointer.wait()
    if run.stopped_by:
        run.logger.info(f"stopped by {run.stopped_by} at step {run.step}; continue with checkpoint.resume=auto "
                        f"and the same hydra.run.dir")


def evaluate(run) -> dict:
    """Token-weighted validation loss and perplexity over the first `eval.max_sequences` of the split (of each
    task's split, with data.kind=mixture: then also each task's validation loss)."""
    tasks = run.data.tasks
    per_task = [_eval_split(run, run.data.val_of_task(t)) for t in range(len(tasks))] if tasks \
        else [_eval_split(run, run.data.val)]
    totals = [t for t in per_task if t is not None]
    if not totals:
        return {}
    val_loss = sum(t[0] for t in totals) / sum(t[1] for t in totals)
    out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
    if tasks:
        out["val_loss_by_task"] = {name: t[0] / t[1] if t is not None and t[1] else None
                                   for name, t in zip(tasks, per_task)}
    return out


def _eval_split(run, val):
    """(token-loss sum, target tokens) of the first eval.max_sequences sequences of `val` over all data-parallel
    ranks, or None when it is empty."""
    cfg, strategy = run.cfg, run.strategy
    n = len(val) if not cfg.eval.max_sequences else min(len(val), cfg.eval.max_sequences)
    if n == 0:
        return None
    # Every data-parallel rank takes a strided share; ranks may get one sequence more than others. Sharded layouts
    # (FSDP, ZeRO-3) gather parameters in each forward, so every rank runs as many micro-batches as the one with
    # most: a rank short of sequences fills its last batch with the split's first sequence, without targets.
    rank, size = strategy.eval_coordinates
    mine = np.arange(n)[rank::size]
    mbs = cfg.train.micro_batch_size
    share = -(-n // size)
    padded = np.concatenate([mine, np.zeros(share - len(mine), dtype=mine.dtype)])
    batches = []
    for i in range(0, share, mbs):
        batch = val.get(padded[i:i + mbs])
        batch["labels"][max(0, len(mine) - i):] = IGNORE
        batches.append(batch)
    strategy.model.eval()
    loss_sum = strategy.eval_loss_sum(batches)
    strategy.model.train()
    targets = torch.tensor(float(val.count_targets(mine)) if len(mine) else 0.0, device=run.device)
    totals = strategy.dp_sum(torch.stack([loss_sum.float(), targets]))
    return float(totals[0]), float(totals[1])


def export_final(run) -> None:
    if run.cfg.export.hf_at_end and not run.stopped_by:
        out = os.path.join(run.run_dir, "hf")
        with run.watchdog.exempt("export"):
            # peft=lora: the merged model in hf/, the adapter alone in hf-adapter/
            written = run.strategy.export_hf(out, run.tokenizer, adapter_dir=os.path.join(run.run_dir, "hf-adapter"))
        run.logger.info(f"exported the model to {' and '.join(written)}")
