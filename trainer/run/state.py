"""The train state: what a checkpoint restores about the run's progress, as objects implementing
torch.distributed.checkpoint.stateful.Stateful (state_dict / load_state_dict).

- `TrainState`: optimizer steps done, target tokens seen, skipped steps (the loop's counters);
- `DataPosition`: the sampler's position, which is a function of the step (a followed stream: its offsets);
- `RandomState`: this process' Python / NumPy / torch / CUDA generators.

The composition root (trainer/run/build.py `train_states`) hands the checkpoint manager these, with the scheduler
and the loss scaler, as one dict name -> Stateful; the manager decides where each goes on disk
(trainer/checkpoint/manager.py: meta.json, rng/rank_<r>.pt), with the keys of earlier checkpoints.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """The counters a checkpoint carries for the loop: optimizer steps done, target tokens seen, skipped steps."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]


class DataPosition(Stateful):
    """The sampler's position at the train state's step (meta.json `loader`)."""

    def __init__(self, sampler, train_state: TrainState):
        self.sampler, self.train_state = sampler, train_state

    def state_dict(self) -> dict:
        return self.sampler.state_dict(self.train_state.step)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)  # data.follow: the stream's position (else nothing)


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


class RandomState(Stateful):
    """This process' random generators (rng/rank_<r>.pt: restored only at the world size they were saved at)."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)
