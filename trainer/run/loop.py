"""The strategy-agnostic training and evaluation loop.

Per optimizer step: the global batch comes from the sampler, its target-token count is read from the data
(every rank can, so no collective is needed for it), this rank's slice is cut into micro-batches, and the
strategy runs forward/backward and the optimizer step. The loop never asks which strategy it runs.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from trainer.observe import comm_bytes
from trainer.data.datasets import IGNORE
from trainer.exporting.live import export_hf
from trainer.resilience.divergence import DivergenceGuard
from trainer.observe.memory import FirstStepProbe, write_report
from trainer.observe.metrics import Throughput, device_peak_tflops, flops_per_token, peak_memory_gib


@dataclass
class _Meters:
    """The loop's clock and the figures of its log records: tokens/s (time aside excluded) and MFU."""

    throughput: Throughput
    flops_tok: float
    peak: float
    started: float = 0.0


@dataclass
class StepResult:
    """What one optimizer step leaves for its log record and the divergence guard."""

    k: int  # the step's index: the global batch it trained on (the step done is k + 1)
    lr: float
    loss_sum: object
    grad_norm: object
    skipped: bool
    n_target: int  # target tokens the step trained on
    n_sequences: int  # sequences (rows) in the global batch
    n_loss: int  # what the step's loss is averaged over (the objective's loss units: target tokens, or pairs)


RETRY = "retry"  # a step not taken (a replica group failed during it): run it again


def fit(run) -> None:
    """Train from run.step to train.max_steps or a stop: per step the train step, its log record (with an
    evaluation when due), the memory report after the first, and the after-step work (checkpoint, snapshot, stop);
    then the final check and save."""
    cfg, t = run.cfg, run.cfg.train
    meters = _meters(run)
    if cfg.eval.at_start and run.step == 0:
        results = evaluate(run)
        if results:  # data.follow has no validation split
            run.logger.eval_record(0, results)
    strategy = run.strategy
    strategy.model.train()
    # logging.memory_report: probe the first step's model-state memory (trainer/observe/memory.py)
    probe = FirstStepProbe(strategy) if cfg.logging.memory_report else None
    guard = DivergenceGuard(run.checkpointer, run.logger.info, t.loss_spike_factor,
                            announce_skips=strategy.skip_nonfinite and strategy.precision.scaler is None)
    comm = comm_bytes.COUNTER
    meters.started = time.monotonic()
    while run.step < t.max_steps:
        result = train_step(run, comm)
        if result is RETRY:
            continue
        if result is None:
            break
        guard.observe(run.step, result.grad_norm, result.skipped)
        meters.throughput.add(result.n_target, result.n_sequences * cfg.data.seq_len)
        record = log_record(run, result, meters, comm) if _logs(run) else None
        run.logger.advance(run.step, record)
        if record is not None:
            guard.check_logged(run.step, record["loss"], result.skipped)  # after the record is logged: it shows it
        if probe is not None:
            _memory_report(run, probe, meters)
            probe = None
        if after_step(run, guard, meters):
            break
    _finish(run, guard)


def _meters(run) -> _Meters:
    cfg, info = run.cfg, run.model_facts.info
    throughput = Throughput()
    embed_params = info.vocab_size * info.hidden_size
    flops_tok = flops_per_token(run.model_facts.num_params - embed_params, info.num_layers, info.hidden_size,
                                cfg.data.seq_len)
    return _Meters(throughput, flops_tok, device_peak_tflops(run.device, cfg.logging.peak_tflops))


def train_step(run, comm):
    """One optimizer step on the global batch of run.step: a StepResult; RETRY when the strategy did not commit it;
    None when there is no step to take (train.max_steps reached, or data.follow ended while waiting)."""
    strategy, t, state = run.strategy, run.cfg.train, run.state
    run.ft.begin_step(state.step)  # a replica group that recovers from a peer may move the train state here
    k = state.step
    if k >= t.max_steps:
        return None
    global_batch = run.sampler.global_batch(k)
    if global_batch is None:  # data.follow: a stop signal, or no new record for its idle limit, while waiting
        run.stopped_by = run.stop.name
        return None
    n_target = run.data.train.count_targets(global_batch)
    n_loss = run.objective.loss_units(n_target, global_batch)  # target tokens, or preference pairs
    positions = run.sampler.micro_batches(k, strategy.dp_rank, strategy.dp_size, t.micro_batch_size)
    micro_batches = [run.data.train.get(pos) for pos in positions]
    lr = strategy.optimizer.param_groups[0]["lr"]
    with comm.window():  # the step's collectives: comm_bytes
        loss_sum = strategy.forward_backward(micro_batches, n_loss, run.sync.grad_weight)
        grad_norm, skipped = run.ft.optimizer_step(strategy, loss_sum, micro_batches, n_loss, t.grad_clip)
        run.sync.after_step(k + 1)  # local SGD / DiLoCo: the workers meet every sync.every steps
    if not run.ft.committed():  # not taken (a replica group failed during it): the same step again
        return RETRY
    run.scheduler.step()
    state.step += 1
    n_target = run.ft.trained_tokens(n_target)
    state.tokens_seen += n_target
    state.skipped_steps += int(skipped)
    run.watchdog.finished_step(state.step)
    return StepResult(k, lr, loss_sum, grad_norm, skipped, n_target, len(global_batch) * run.objective.rows_per_item,
                      n_loss)


def _eval_due(run) -> bool:
    cfg, step = run.cfg, run.step
    periodic_eval = cfg.eval.every > 0 and step % cfg.eval.every == 0
    return periodic_eval or (step == cfg.train.max_steps and cfg.eval.at_end)


def _logs(run) -> bool:
    """This step gets a log record: every train.log_every steps, the last one, and where an evaluation runs."""
    t = run.cfg.train
    return run.step % t.log_every == 0 or run.step == t.max_steps or _eval_due(run)


def log_record(run, result: StepResult, meters: _Meters, comm) -> dict:
    """The metrics.jsonl record of the step just taken (with the evaluation's results where one is due)."""
    strategy, state = run.strategy, run.state
    loss = run.ft.step_loss(strategy, result.loss_sum, result.n_loss)
    tok_s, seq_tok_s = meters.throughput.take()
    record = {"step": state.step, "loss": loss, "lr": result.lr, "grad_norm": float(result.grad_norm),
              "tokens": state.tokens_seen, "tokens_per_s": tok_s, "seq_tokens_per_s": seq_tok_s,
              "epoch": run.sampler.epoch_of(result.k), "skipped_steps": state.skipped_steps,
              "peak_mem_gib": peak_memory_gib(run.device), "time": round(time.time(), 3)}
    record.update(run.ft.metrics())
    task_sums = strategy.task_sums()  # data.kind=mixture: each task's loss and target tokens
    if task_sums is not None:
        record["tasks"] = _task_figures(run, task_sums)
    objective_metrics = run.objective.metrics(strategy.dp_sum)  # a preference objective's rewards and accuracy
    if objective_metrics:
        record[run.objective.name] = objective_metrics
    aux = strategy.router_aux_loss()  # a mixture of experts' load-balancing term (model.router_aux_loss_coef)
    if aux is not None:
        record["router_aux_loss"] = aux
    if strategy.caps.counts_all_collectives:
        record.update(comm.take() or {})
    if strategy.precision.loss_scale is not None:
        record["loss_scale"] = strategy.precision.loss_scale
    if meters.peak:
        record["mfu"] = seq_tok_s * meters.flops_tok / (meters.peak * 1e12 * strategy.dims.world_size)
    if _eval_due(run):
        record.update(_evaluate_step(run, meters))
    return record


def _task_figures(run, task_sums) -> dict:
    """Each task's figures of the step: a preference objective's own (pair loss, pairs, rewards, accuracy), else
    the token loss and target tokens the strategy summed."""
    per_task = run.objective.task_metrics(run.strategy.dp_sum)
    if per_task is not None:
        return dict(zip(run.data.tasks, per_task))
    return {name: {"loss": float(s / n) if n else None, "tokens": int(n)}
            for name, (s, n) in zip(run.data.tasks, task_sums.tolist())}


def _evaluate_step(run, meters: _Meters) -> dict:
    """The evaluation of a logged step (eval.jsonl too), its time left out of tokens/s."""
    t_eval = time.perf_counter()
    with run.watchdog.exempt("evaluation"):
        results = evaluate(run)
    if results:
        run.logger.eval_record(run.step, results)
    meters.throughput.exclude(time.perf_counter() - t_eval)
    return results


def _memory_report(run, probe: FirstStepProbe, meters: _Meters) -> None:
    """All ranks, after the first step: gather, log one line, write memory.json (left out of tokens/s)."""
    t_aside = time.perf_counter()
    with run.watchdog.exempt("memory report"):
        write_report(probe, run.strategy, run.model_facts, run.step, run.run_dir, run.logger.info,
                     {"strategy": run.cfg.strategy.name, "precision": run.cfg.precision.name})
    meters.throughput.exclude(time.perf_counter() - t_aside)


def after_step(run, guard: DivergenceGuard, meters: _Meters) -> bool:
    """The work after a step: finish a background save, agree on a stop (then True: the loop ends), save a
    checkpoint and publish a snapshot when due (from finite weights only; their time left out of tokens/s)."""
    t = run.cfg.train
    run.checkpointer.poll()
    if t.max_time_s and time.monotonic() - meters.started >= t.max_time_s:
        run.stop.request("train.max_time_s")  # agreed below: any rank past the limit stops them all
    if run.stop.agreed():
        run.stopped_by = run.stop.name
        what = run.stopped_by if run.stop.reason else f"{run.stopped_by} received"
        run.logger.info(f"{what}: stopping after step {run.step}")
        return True
    t_aside = time.perf_counter()
    if run.checkpointer.due(run.step):
        guard.check(run.step)  # only finite weights are ever saved
    with run.watchdog.exempt("checkpoint save"):
        run.checkpointer.maybe_save(run.step)  # a save's wait is reported by the checkpointer, not in tokens/s
    if run.snapshots.due(run.step):  # export.snapshot_every: a served model follows the training
        guard.check(run.step)
        with run.watchdog.exempt("snapshot"):
            export_hf(run.strategy, run.cfg, run.snapshots.folder(run.step), run.tokenizer)
            run.snapshots.publish(run.step)
    meters.throughput.exclude(time.perf_counter() - t_aside)
    return False


def _finish(run, guard: DivergenceGuard) -> None:
    """After the loop: the final divergence check, the last save (at_end, or a stop) and the wait for it."""
    guard.check(run.step)
    with run.watchdog.exempt("checkpoint save"):
        if run.cfg.checkpoint.at_end or run.stopped_by:
            run.checkpointer.save(run.step)
        run.checkpointer.wait()
    if run.stopped_by:
        run.logger.info(f"stopped by {run.stopped_by} at step {run.step}; continue with checkpoint.resume=auto "
                        f"and the same hydra.run.dir")


def evaluate(run) -> dict:
    """Token-weighted validation loss and perplexity over the first `eval.max_sequences` of the split (of each
    task's split, with data.kind=mixture: then also each task's validation loss)."""
    tasks = run.data.tasks
    run.objective.reset()
    per_task = [_eval_split(run, run.data.val_of_task(t)) for t in range(len(tasks))] if tasks \
        else [_eval_split(run, run.data.val)]
    totals = [t for t in per_task if t is not None]
    if not totals:
        return {}
    val_loss = sum(t[0] for t in totals) / sum(t[1] for t in totals)
    out = {"val_loss": val_loss}
    objective_metrics = run.objective.metrics(run.strategy.dp_sum)
    if objective_metrics:  # a preference objective's: its loss is no token cross-entropy (no perplexity)
        out[f"val_{run.objective.name}"] = objective_metrics
    else:
        out["val_ppl"] = math.exp(min(val_loss, 50.0))
    if tasks:
        out["val_loss_by_task"] = {name: t[0] / t[1] if t is not None and t[1] else None
                                   for name, t in zip(tasks, per_task)}
        figures = run.objective.task_metrics(run.strategy.dp_sum)
        if figures is not None:  # a preference objective's rewards and accuracy per task
            out[f"val_{run.objective.name}_by_task"] = dict(zip(tasks, figures))
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
    rows = run.objective.rows_per_item  # a batch row per item, or two (a preference pair)
    for i in range(0, share, mbs):
        batch = val.get(padded[i:i + mbs])
        batch["labels"][max(0, len(mine) - i) * rows:] = IGNORE
        batches.append(batch)
    strategy.model.eval()
    loss_sum = strategy.eval_loss_sum(batches)
    strategy.model.train()
    units = run.objective.loss_units(val.count_targets(mine), mine) if len(mine) else 0
    targets = torch.tensor(float(units), device=run.device)
    totals = strategy.dp_sum(torch.stack([loss_sum.float(), targets]))
    return float(totals[0]), float(totals[1])


def export_final(run) -> None:
    if run.cfg.export.hf_at_end and not run.stopped_by:
        out = os.path.join(run.run_dir, "hf")
        with run.watchdog.exempt("export"):
            # peft=lora: the merged model in hf/, the adapter alone in hf-adapter/
            written = export_hf(run.strategy, run.cfg, out, run.tokenizer,
                                adapter_dir=os.path.join(run.run_dir, "hf-adapter"))
        run.logger.info(f"exported the model to {' and '.join(written)}")
        run.logger.exported(written)  # the folders' paths to the experiment trackers
