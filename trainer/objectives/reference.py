"""The reference model of DPO and IPO, scored once: before the first step, the starting model (the model the run
trains from: the pretrained or preset weights, with fresh LoRA adapters the base with adapters off, with
peft.adapter the base with that adapter) computes the log-probability of every pair's chosen and rejected response
(train and validation), on the run's own backend and layout, its data-parallel ranks taking a share each, forward
only in eval mode. The scores are kept beside the token cache as `<cache>/reference/<key>.npy`, the key a digest
of the model's identity (its config, weights files, seed, adapters, quantization), the precision and the data's
fingerprint; a run or a resume with the same key reads them (so the training process holds one model), and the
key joins the data fingerprint that checkpoints carry (a resume with other reference scores is refused).

objective.reference=on_the_fly keeps the reference live instead: a frozen copy of the starting model, built and
sharded as the trained one is (with LoRA: the trained model's base with its adapters off), scores each micro-batch's
pairs before the policy's forward. Both ways score one pair per forward in eval mode, so a pair's scores do not
depend on the pairs beside it and the live scores equal the saved ones bit for bit."""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Callable, Optional

import numpy as np
import torch

from tessera.errors import DataError, one_line
from trainer.data.datasets import IGNORE
from trainer.data.sources import files_fingerprint
from trainer.data.store import default_cache_dir, file_lock
from trainer.objectives.preference import NEEDS_REFERENCE, sequence_logps


def reference_key(cfg, data_fingerprint: str) -> str:
    """The identity of a run's reference scores."""
    m = cfg.model
    weights = sorted(glob.glob(os.path.join(m.name_or_path, "*"))) if m.name_or_path and \
        os.path.isdir(m.name_or_path) else []
    adapter = sorted(glob.glob(os.path.join(cfg.peft.adapter, "*"))) if cfg.peft.adapter else []
    identity = {"model": dataclasses.asdict(m), "weights": files_fingerprint(weights) if weights else None,
                "seed": cfg.train.seed if m.kind != "hf" else None, "adapter": files_fingerprint(adapter) or None,
                "quantization": cfg.peft.quantization, "precision": cfg.precision.name, "data": data_fingerprint}
    identity["model"].pop("router_aux_loss_coef", None)  # a training knob, not the model's output
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


class ReferenceScorer:
    """An objective that keeps each row's response log-probability by pair (rows: chosen, rejected) and adds no
    loss: the strategy's evaluation forward runs it."""

    def __init__(self, num_pairs: int):
        self.scores = torch.zeros(num_pairs, 2, dtype=torch.float64)

    def loss_sum(self, logits, batch: dict, tasks=None) -> torch.Tensor:
        logps, tokens = sequence_logps(logits, batch["labels"])
        real = ((tokens[0::2] > 0) & (tokens[1::2] > 0)).cpu()  # the evaluation's fillers have no targets
        pairs = batch["pair_ids"].cpu()[real]
        self.scores[pairs] = torch.stack([logps[0::2], logps[1::2]], 1).detach().double().cpu()[real]
        return logits.new_zeros(())

    def prepare(self, batch: dict) -> dict:
        return batch

    def reset(self) -> None:
        pass


class LiveReference:
    """objective.reference=on_the_fly: each micro-batch's reference log-probabilities from `forward` (a batch of one
    pair -> its logits: the frozen reference's forward, in eval mode, without gradients)."""

    def __init__(self, forward: Callable[[dict], torch.Tensor]):
        self.forward = forward

    @torch.no_grad()
    def logps(self, batch: dict) -> torch.Tensor:
        """[rows] fp32: each row's response log-probability, one pair (two rows) per forward, as the scoring pass
        computes it."""
        out = []
        for row in range(0, batch["input_ids"].shape[0], 2):
            pair = {"input_ids": batch["input_ids"][row:row + 2], "labels": batch["labels"][row:row + 2]}
            out.append(sequence_logps(self.forward(pair), pair["labels"])[0])
        return torch.cat(out).float()


def live_reference(cfg) -> Optional[str]:
    """What objective.reference=on_the_fly holds for an objective with a reference: "adapters_off" (a LoRA run's own
    base with its adapters off) or "copy" (a second, frozen model); None for the offline scores or no reference."""
    o = cfg.objective
    if o.name == "lm" or o.reference != "on_the_fly" or not NEEDS_REFERENCE[o.name]:
        return None
    return "adapters_off" if cfg.peft.name != "none" else "copy"


def add_reference_identity(cfg, data) -> None:
    """DPO / IPO: the reference scores' key joins the data's fingerprint (before a resume compares it); a mixture's
    preference sources each have their own scores and key."""
    if cfg.objective.name == "lm" or not NEEDS_REFERENCE[cfg.objective.name]:
        return
    sources = _pair_sources(data)
    for source in sources:
        source.reference_key = reference_key(cfg, source.fingerprint)
    if getattr(data, "sources", ()):
        data.reference_key = hashlib.sha256("|".join(s.reference_key for s in sources).encode()).hexdigest()[:20]
    data.fingerprint += f":ref{data.reference_key}"


def _pair_sources(data) -> list:
    """The DataSplits whose pairs have reference scores of their own: a mixture's sources, or the data itself."""
    return list(getattr(data, "sources", ())) or [data]


def attach_reference(run) -> None:
    """Give the run's preference pairs their reference scores (read, or scored now and saved). A no-op for
    objectives without a reference or with a live one."""
    if not run.objective.needs_reference or run.objective.live_reference is not None:
        return
    names = run.data.tasks or ("",)
    for name, source in zip(names, _pair_sources(run.data)):
        _attach(run, source.train.base, source.reference_key, f" of source {name}" if name else "")


def _attach(run, pairs, key: str, which: str) -> None:
    path = os.path.join(run.cfg.data.cache_dir or default_cache_dir(), "reference", f"{key}.npy")
    scores = _read(path, pairs.num_pairs) if _everyone_has(path, run.device) else None
    if scores is None:
        run.logger.info(f"scoring {len(pairs)} preference pairs{which} with the reference (starting) model")
        scores = score_pairs(run, pairs)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # each node's cache folder (shared or not)
            _write(path, scores)
        run.logger.info(f"reference scores saved to {path}")
    else:
        run.logger.info(f"reference scores{which} read from {path}")
    pairs.reference = scores.astype(np.float32)


def score_pairs(run, pairs) -> np.ndarray:
    """[stored pairs, 2] reference log-probabilities (chosen, rejected); NaN for pairs that do not train. One pair
    per forward (what objective.reference=on_the_fly computes too), a micro-batch's worth of them per call."""
    strategy, mbs = run.strategy, run.cfg.train.micro_batch_size
    n = len(pairs)
    rank, size = strategy.dp_rank, strategy.dp_size
    mine = np.arange(n)[rank::size]
    share = -(-n // size)  # every rank runs as many forwards (sharded layouts gather in each)
    padded = np.concatenate([mine, np.zeros(share - len(mine), dtype=mine.dtype)])
    scorer, objective = ReferenceScorer(pairs.num_pairs), strategy.objective
    strategy.use_objective(scorer)
    strategy.model.eval()
    try:
        for i in range(0, share, mbs):
            strategy.eval_loss_sum([_one_pair(pairs, padded, j, len(mine)) for j in range(i, min(i + mbs, share))])
    finally:
        strategy.model.train()
        strategy.use_objective(objective)
    scores = strategy.dp_sum(scorer.scores.to(run.device)).cpu().numpy()
    kept = np.zeros(pairs.num_pairs, dtype=bool)
    kept[pairs.keep] = True
    scores[~kept] = np.nan
    return scores


def _one_pair(pairs, indices: np.ndarray, j: int, real: int) -> dict:
    """The batch of pair indices[j]; past the `real` ones a filler without targets (ranks run equal forwards)."""
    batch = pairs.get(indices[j:j + 1])
    if j >= real:
        batch["labels"][:] = IGNORE
    return batch


def _read(path: str, num_pairs: int) -> Optional[np.ndarray]:
    if not os.path.exists(path):
        return None
    try:
        scores = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"the reference scores {path} cannot be read ({one_line(e)}); delete the file to score "
                        f"again") from None
    if scores.shape != (num_pairs, 2):
        raise DataError(f"the reference scores {path} hold {scores.shape[0]} pairs, the data {num_pairs}; delete the "
                        f"file to score again")
    return scores


def _write(path: str, scores: np.ndarray) -> None:
    """Whole or not at all: a temporary file, then a rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with file_lock(path + ".lock"):
        tmp = f"{path}.tmp-{os.getpid()}.npy"
        np.save(tmp, scores)
        os.replace(tmp, path)


def _everyone_has(path: str, device) -> bool:
    """Whether every rank sees the scores file (node-local caches may differ): all read, or all score."""
    found = torch.tensor(float(os.path.exists(path)), device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MIN)
    return bool(found.item())
