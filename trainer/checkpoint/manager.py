"""Checkpoints: one manager behind a narrow interface, atomic on disk, exact resume, any world size.

Layout of `<run dir>/checkpoints/`:

    step_<N>/             a complete checkpoint (only complete ones ever carry this name)
      COMPLETE.json       written last: step and the size of every file (truncation is detected on load)
      meta.json           step, tokens, loader position, scheduler, loss scaler, optimizer hyper-parameters,
                          model shapes, data fingerprint, the degrees it was saved with
      config.yaml         the resolved config of the run that saved it
      rng/rank_<r>.pt     each rank's Python / NumPy / torch / CUDA RNG states
      hf_config/          the model's HF config, generation config and tokenizer (for `python -m trainer.export`)
      *.distcp, .metadata model and optimizer tensors, sharded by torch.distributed.checkpoint (DCP)
    .tmp-step_<N>/        a save in progress, or one that died; never resumed from, removed by the next save
    latest                the name of the newest complete checkpoint (moved only after it is complete)

A save writes everything into `.tmp-step_<N>`; once every rank has written its part (DCP's collective finish
step guarantees it), rank 0 writes COMPLETE.json and renames the folder to `step_<N>`: a crash at any moment
leaves the earlier checkpoints as they were. DCP writes only tensors here (everything else is JSON), and
loading reads DCP's metadata with an unpickler that admits only DCP's own record types by exact name, and
every other pickle weights-only (trainer/checkpoint/safe_load.py), so loading never runs code from a file.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from tessera.errors import CheckpointError, CheckpointSaveError, TesseraError, one_line
from trainer.run.cli import fault_message
from trainer.run.state import TrainState
from trainer.checkpoint.saved import SavedCheckpoint
from trainer.exporting.hf_folder import copy_remote_code

COMPLETE = "COMPLETE.json"
KEEP = "KEEP.json"  # a pinned checkpoint (e.g. the last finite one before divergence): never rotated away
STEP_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-step_"
FORMAT = 1

# One process without a process group is a normal case here (strategy=single), not something to warn about.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# --------------------------------------------------------------------------------------------------------
# Safe reading of DCP checkpoints: trainer/checkpoint/safe_load.py holds every unpickling (exact allow-lists).

from tessera.pickles import load_tensors  # noqa: E402
from trainer.checkpoint.safe_load import SafeFileSystemReader  # noqa: E402


# --------------------------------------------------------------------------------------------------------
# Finding checkpoints.

def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = STEP_RE.match(name)
            if m and os.path.isfile(os.path.join(root, name, COMPLETE)):
                out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def partial_checkpoints(root: str) -> List[str]:
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if n.startswith(TMP_PREFIX) or STEP_RE.match(n) and not os.path.isfile(os.path.join(root, n, COMPLETE)))


def resolve(spec: str, run_dir: str, key: str = "checkpoint.resume") -> Optional[str]:
    """`auto` -> the newest complete checkpoint of this run (or None); a path -> a complete checkpoint folder:
    the path itself, or the newest under it (a checkpoints folder or a run directory)."""
    if spec == "none":
        return None
    if spec == "auto":
        found = complete_checkpoints(os.path.join(run_dir, "checkpoints"))
        return found[-1][1] if found else None
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path):
        raise CheckpointError(f"{key}={spec!r}: no such path")
    if os.path.isfile(os.path.join(path, COMPLETE)):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = complete_checkpoints(root)
        if found:
            return found[-1][1]
    if os.path.isfile(os.path.join(path, "meta.json")):
        raise CheckpointError(f"{key}={spec!r} is an incomplete checkpoint (no {COMPLETE}): its save "
                              f"did not finish; resume from an earlier one")
    raise CheckpointError(f"{key}={spec!r} holds no complete checkpoint")


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as fh:
            meta = json.load(fh)
        with open(os.path.join(path, COMPLETE)) as fh:
            meta["_complete"] = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({one_line(e)}); resume from another one") from None
    if damaged_files(path, meta, ["meta.json", "config.yaml"]):
        raise CheckpointError(f"checkpoint {path} is damaged: meta.json or config.yaml differs from what was "
                              f"saved (checksum); resume from another one")
    return meta


def verify_files(path: str, meta: dict, checksums: bool = False) -> None:
    """Every file the save wrote is there with the size it had (truncation, missing shards) and, with
    `checksums`, the content it had (bit flips; one process reads every byte: `CheckpointManager.damaged`
    shares that work among the ranks)."""
    for rel, size in meta["_complete"]["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path} is damaged: {rel} is missing")
        actual = os.path.getsize(full)
        if actual != size:
            raise CheckpointError(f"checkpoint {path} is damaged: {rel} has {actual} bytes, {size} were written")
    bad = damaged_files(path, meta) if checksums else []
    if bad:
        raise CheckpointError(f"checkpoint {path} is damaged: {len(bad)} file(s) differ from what was saved "
                              f"(checksum), e.g. {bad[0]}")
    if os.path.isfile(os.path.join(path, ".metadata")):
        try:
            SafeFileSystemReader(path).read_metadata()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise CheckpointError(f"cannot load checkpoint {path}: its .metadata is damaged ({one_line(e)}); "
                                  f"resume from another one") from None


WEIGHTS_ONLY_HINT = " (or set checkpoint.load_weights_only=true to start a new run from its weights)"


def compatibility_problems(meta: dict, cfg, model_shapes: Dict[str, list], data_fingerprint: str,
                           weights_only: bool, checkpoint_format: str = "dcp", dp_size: int = 1,
                           hint: str = WEIGHTS_ONLY_HINT, peft: Optional[dict] = None) -> List[str]:
    """What makes a checkpoint unusable for this run, each naming the mismatch (`hint`: how to start from its
    weights instead; `peft`: this run's adapters, models.lora.Adapters.summary)."""
    saved_peft = meta.get("peft")
    if saved_peft != peft:
        if not saved_peft or not peft:
            what = (f"LoRA adapters only (r={saved_peft['r']})" if saved_peft else "the whole model")
            fix = ("set peft=lora with the run's peft.* values" if saved_peft else
                   "export it (python -m trainer.export <checkpoint> <folder>) and start from model=hf "
                   "model.name_or_path=<folder> peft=lora")
            return [f"the checkpoint holds {what} and this run trains "
                    f"{'LoRA adapters' if peft else 'the whole model'}: {fix}"]
        diff = [k for k in peft if peft[k] != saved_peft.get(k)]
        return [f"the checkpoint's LoRA adapters differ from this run's in {', '.join(diff)} (checkpoint: "
                + ", ".join(f"{k}={saved_peft.get(k)}" for k in diff if k != "modules")
                + "); set peft.* as the run that saved it had them"]
    problems = []
    saved = meta.get("model_shapes", {})
    missing = sorted(set(saved) - set(model_shapes))
    extra = sorted(set(model_shapes) - set(saved))
    shape = sorted(k for k in set(saved) & set(model_shapes) if list(saved[k]) != list(model_shapes[k]))
    if missing or extra or shape:
        detail = []
        if shape:
            detail.append("shapes differ: " + ", ".join(f"{k} {saved[k]} (checkpoint) vs {model_shapes[k]} (model)"
                                                        for k in shape[:3]))
        if missing:
            detail.append(f"{len(missing)} tensors only in the checkpoint (e.g. {missing[0]})")
        if extra:
            detail.append(f"{len(extra)} tensors only in the model (e.g. {extra[0]})")
        problems.append(f"the checkpoint holds another model ({meta.get('model_desc', '?')}): " + "; ".join(detail))
    saved_format = meta.get("checkpoint_format", "dcp")
    if saved_format != checkpoint_format:
        problems.append(f"the checkpoint is in {saved_format} format (saved by strategy={meta.get('strategy')}) and "
                        f"strategy={cfg.strategy.name} reads {checkpoint_format}; resume with a strategy of that "
                        f"format, or export it (python -m trainer.export) and start from model=hf")
    if weights_only:
        return problems
    if meta.get("optim_name") != cfg.optim.name:
        problems.append(f"optim.name={cfg.optim.name!r} but the checkpoint was trained with "
                        f"{meta.get('optim_name')!r}{hint}")
    if meta.get("global_batch_size") != cfg.train.global_batch_size:
        problems.append(f"train.global_batch_size={cfg.train.global_batch_size} but the checkpoint was saved with "
                        f"{meta.get('global_batch_size')}: the data position would not carry over{hint}")
    if meta.get("data_fingerprint") != data_fingerprint:
        problems.append(f"the data differs from the checkpoint's (data.* / data.seq_len / tokenizer: "
                        f"{meta.get('data_fingerprint')} vs {data_fingerprint}){hint}")
    return problems


def identity_meta(identity, strategy) -> dict:
    """What compatibility_problems reads of a checkpoint's meta.json, for a live run (a replica group that another
    group recovers from)."""
    cfg = identity.cfg
    return {"optim_name": cfg.optim.name, "global_batch_size": cfg.train.global_batch_size,
            "data_fingerprint": identity.data_fingerprint, "model_shapes": identity.model_shapes,
            "model_desc": identity.model_desc, "strategy": cfg.strategy.name,
            "checkpoint_format": strategy.caps.checkpoint_format, "peft": identity.peft}


def check_peer_identity(meta: dict, identity, strategy) -> None:
    """A replica group may take a live group's state only where it could resume that group's checkpoint."""
    problems = compatibility_problems(meta, identity.cfg, identity.model_shapes, identity.data_fingerprint, False,
                                      strategy.caps.checkpoint_format, hint="", peft=identity.peft)
    if problems:
        raise CheckpointError("this replica group cannot take the live groups' state (they train another run):\n"
                              + "\n".join(f"  - {x}" for x in problems))


# --------------------------------------------------------------------------------------------------------

def _files_with_sizes(folder: str) -> Dict[str, int]:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            full = os.path.join(base, f)
            out[os.path.relpath(full, folder)] = os.path.getsize(full)
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while True:
            chunk = fh.read(1 << 23)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)  # hashlib releases the GIL on large buffers: files hash in parallel threads


def file_checksums(folder: str, rels) -> Dict[str, str]:
    """SHA-256 of each file (relative paths under `folder`), several files at a time."""
    from concurrent.futures import ThreadPoolExecutor

    rels = sorted(rels)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as pool:
        digests = list(pool.map(lambda rel: _sha256(os.path.join(folder, rel)), rels))
    return dict(zip(rels, digests))


def damaged_files(path: str, meta: dict, rels=None) -> List[str]:
    """Files of a sealed checkpoint whose content differs from what the save wrote (SHA-256 in COMPLETE.json);
    `rels` restricts the check to some of them. Checkpoints sealed before checksums existed pass."""
    sums = meta["_complete"].get("sha256")
    if not sums:
        return []
    rels = sorted(sums) if rels is None else [r for r in rels if r in sums]
    found = file_checksums(path, [r for r in rels if os.path.isfile(os.path.join(path, r))])
    return [r for r in rels if found.get(r) != sums[r]]


class _Checksums:
    def __init__(self, sums: Dict[str, str], seconds: float):
        self.sums, self.seconds = sums, seconds


def _then_checksums(future, folder: str):
    """A future that resolves, after `future` (an async save), to the _Checksums of the files in `folder`."""
    import concurrent.futures
    import threading

    out = concurrent.futures.Future()

    def work():
        try:
            future.result()
            t0 = time.perf_counter()
            out.set_result(_Checksums(file_checksums(folder, _files_with_sizes(folder)), time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the save
            out.set_exception(e)

    threading.Thread(target=work, name="checkpoint-checksums", daemon=True).start()
    return out


def _write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


TrainingProgress = TrainState  # the earlier name of the loop's counters (trainer/run/state.py)

# Where each train state (name -> Stateful, CheckpointManager's `states`) goes: "progress" spreads its keys over
# meta.json's top level, "rng" is one file per rank (rng/rank_<r>.pt, restored at the same world size only), every
# other name is a meta.json entry of its own (in the order given: "loader", "scheduler", "precision", "trackers").
# "trackers" (the experiment trackers' runs) is absent from checkpoints saved before trackers existed: nothing to
# restore then.
PROGRESS, RNG, TRACKERS = "progress", "rng", "trackers"


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint records about the run that saved it and that resuming checks: fixed for the run's life."""

    cfg: object  # the resolved TesseraConfig: config.yaml, and the optimizer, batch and strategy it names
    data_fingerprint: str
    model_shapes: Dict[str, list]
    model_desc: str
    tokenizer: object  # saved beside the model's config (hf_config/) for `python -m trainer.export`
    peft: Optional[dict] = None  # peft=lora: the adapters (models.lora.Adapters.summary); the checkpoint holds them


def _save_failure(e: BaseException, folder: str) -> str:
    """Why a save failed, in one line. torch.save's zip writer reports a full disk as "file write failed" without
    an errno, so a failure with (almost) no free space left is named as what it is."""
    reason = one_line(e)
    if "Errno" not in reason:
        try:
            free = shutil.disk_usage(folder if os.path.isdir(folder) else os.path.dirname(folder)).free
        except OSError:
            free = None
        if free is not None and free < 1 << 20:
            return f"No space left on device ({free // 1024} KiB free under {os.path.dirname(folder)}; {reason})"
        # a peer gone or a collective timed out (DCP's gathers): which rank went silent, and what to do
        reason = fault_message(e) or reason
    return reason


class CheckpointManager:
    """save(step) / load(path, weights_only) / wait() / close(). The strategy saves and loads the model and
    optimizer tensors; `states` (name -> Stateful: "progress", the train state's counters; "loader", the data
    position; "scheduler"; "precision", the loss scaler; "rng", this rank's generators) are saved and restored
    each through its own state_dict() / load_state_dict(), where PROGRESS / RNG above say; `rank_states` keep what
    only their rank holds (local_state() / load_local_state(): local/rank_<r>.pt)."""

    def __init__(self, run_dir: str, strategy, states: Dict[str, object], identity: RunIdentity, logger,
                 rank_states: Optional[List[object]] = None):
        self.strategy, self.states = strategy, dict(states)
        # what only this rank holds (local_state() / load_local_state(), one file per rank, same world size only):
        # the strategy's (PowerSGD's error feedback, a local-SGD worker's weights), then the run's synchronisation's
        self.rank_states = list(rank_states) if rank_states is not None else [strategy]
        self.progress = self.states[PROGRESS]
        self.identity, self.logger = identity, logger
        self.cfg = identity.cfg.checkpoint
        self.root = os.path.join(run_dir, "checkpoints")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending = None  # (future, tmp dir, final dir, step, start time) of an async save in flight
        self.last_saved_step = None
        self.stats: List[dict] = []  # per save: step, blocking seconds, total seconds, bytes
        # A gloo group of its own: DCP's coordination (also from the async writer thread) never shares a
        # communicator with training collectives, and works whatever the training backend is.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    # ---- saving -------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def maybe_save(self, step: int, last: bool = False) -> None:
        if self.due(step) or last:
            self.save(step)

    def pin_newest(self, reason: str) -> Optional[str]:
        """Keep the newest complete checkpoint out of keep_last rotation (a KEEP file with the reason); its path."""
        found = complete_checkpoints(self.root)
        if not found:
            return None
        path = found[-1][1]
        if self.rank == 0:
            _write_json_atomic(os.path.join(path, KEEP), {"reason": reason, "time": time.time()})
        return path

    def save(self, step: int) -> None:
        if self.last_saved_step == step:
            return
        t0 = time.perf_counter()  # a previous async save still writing blocks this step too: count it
        self.wait()
        final = os.path.join(self.root, f"step_{step}")
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{step}")
        try:
            if self.rank == 0:
                os.makedirs(self.root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(os.path.join(tmp, "rng"))
                os.makedirs(os.path.join(tmp, "local"))
                self._write_rank0_files(tmp, step)
            self._barrier()  # the folder exists before any rank writes into it
            if RNG in self.states:
                torch.save(self.states[RNG].state_dict(), os.path.join(tmp, "rng", f"rank_{self.rank}.pt"))
            local = {k: v for s in self.rank_states for k, v in s.local_state().items()}
            if local:  # rank 0 made the folder before the barrier
                torch.save(local, os.path.join(tmp, "local", f"rank_{self.rank}.pt"))
            future = self.strategy.save_checkpoint_state(tmp, self.group, self.cfg.async_save)
            if future is not None:
                if self.rank == 0:  # hash the files in the background too, once they are written
                    future = _then_checksums(future, tmp)
                self.pending = (future, tmp, final, step, t0)
                self.stats.append({"step": step, "blocking_s": time.perf_counter() - t0})
            else:
                self._barrier()  # every rank's part is on disk before rank 0 seals the folder
                self.stats.append({"step": step, "blocking_s": None})
                self._finalize(tmp, final, step, t0)
        except (TesseraError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - disk full, a peer's failure (DCP's CheckpointException)
            if os.environ.get("TESSERA_DEBUG"):
                import traceback

                traceback.print_exc()
            reason = _save_failure(e, tmp)  # before abandoning: the partial files still take their space
            self._abandon(tmp)
            raise CheckpointSaveError(f"saving the checkpoint of step {step} failed: {reason}; the earlier "
                                      f"checkpoints are intact") from None
        self.last_saved_step = step

    def wait(self) -> None:
        """Finish an async save in flight (every rank calls this before the next save and at the end)."""
        if self.pending is None:
            return
        future, tmp, final, step, t0 = self.pending
        self.pending = None
        try:
            result = future.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001
            reason = _save_failure(e, tmp)
            self._abandon(tmp)
            raise CheckpointSaveError(f"the background save of step {step} failed: {reason}; the earlier "
                                      f"checkpoints are intact") from None
        self._finalize(tmp, final, step, t0, result if isinstance(result, _Checksums) else None)

    def poll(self) -> None:
        """Finalize an async save as soon as it is done, without waiting for it."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def _finalize(self, tmp: str, final: str, step: int, t0: float, checksums=None) -> None:
        # DCP's save returns (or its future resolves) on the coordinator only after every rank reported its
        # writes done, so rank 0 alone can seal the checkpoint.
        if self.rank == 0:
            files = _files_with_sizes(tmp)
            if checksums is None or set(checksums.sums) != set(files):
                t_sum = time.perf_counter()
                checksums = _Checksums(file_checksums(tmp, files), time.perf_counter() - t_sum)
            sums, checksum_s = checksums.sums, checksums.seconds
            _write_json_atomic(os.path.join(tmp, COMPLETE), {"step": step, "format": FORMAT, "files": files,
                                                              "sha256": sums, "time": time.time()})
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            with open(os.path.join(self.root, "latest.tmp"), "w") as fh:
                fh.write(os.path.basename(final) + "\n")
            os.replace(os.path.join(self.root, "latest.tmp"), os.path.join(self.root, "latest"))
            self._retain(keep=final)
            total = time.perf_counter() - t0
            nbytes = sum(files.values())
            rec = self.stats[-1] if self.stats and self.stats[-1]["step"] == step else {"step": step}
            rec.update(total_s=total, bytes=nbytes, checksum_s=checksum_s)
            self.logger.info(f"saved checkpoint {final} ({nbytes / 2**20:.1f} MiB in {total:.2f}s)")
            self.logger.checkpoint_saved(step, final)  # its path to the experiment trackers

    def _retain(self, keep: str) -> None:
        for stale in partial_checkpoints(self.root):
            if stale != keep:
                shutil.rmtree(stale, ignore_errors=True)
        complete = [(s, p) for s, p in complete_checkpoints(self.root) if not os.path.isfile(os.path.join(p, KEEP))]
        if self.cfg.keep_last > 0:
            for _, path in complete[:-self.cfg.keep_last]:
                shutil.rmtree(path, ignore_errors=True)

    def _abandon(self, tmp: str) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _write_rank0_files(self, tmp: str, step: int) -> None:
        from omegaconf import OmegaConf

        strategy, identity, cfg = self.strategy, self.identity, self.identity.cfg
        meta = {"format": FORMAT, **self.progress.state_dict(), "step": step}  # the key order of earlier saves
        meta.update((name, state.state_dict()) for name, state in self.states.items() if name not in (PROGRESS, RNG))
        meta.update(optim_param_groups=strategy.optimizer_param_groups(),
                    **identity_meta(identity, strategy),  # what resuming checks (compatibility_problems)
                    world_size=strategy.dims.world_size, dp_size=strategy.dp_size)
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(meta, fh, default=_json_default)
        OmegaConf.save(OmegaConf.structured(cfg), os.path.join(tmp, "config.yaml"))
        hf_dir = os.path.join(tmp, "hf_config")
        strategy.unwrapped().config.save_pretrained(hf_dir)
        copy_remote_code(strategy.unwrapped().config, hf_dir)  # remote code: for the export command
        generation = strategy.generation_config
        if generation is not None:  # the export command writes it beside config.json
            generation.save_pretrained(hf_dir)
        identity.tokenizer.save_pretrained(hf_dir)
        if strategy.adapters is not None:  # adapter_config.json: `python -m trainer.export` writes the adapter
            strategy.adapters.config.save_pretrained(hf_dir)

    # ---- loading ------------------------------------------------------------------------------------------
    def damaged(self, path: str) -> List[str]:
        """Files of `path` whose content differs from the save's checksums. Collective: each rank hashes a
        share of the files, so a large checkpoint is read once in all, not once per rank."""
        meta = read_meta(path)
        rels = sorted(meta["_complete"].get("sha256", {}))
        world = dist.get_world_size(self.group) if self.group is not None else 1
        bad = damaged_files(path, meta, rels[self.rank % world::world])
        if self.group is None:
            return bad
        gathered = [None] * world
        dist.all_gather_object(gathered, bad, group=self.group)
        return sorted(f for part in gathered for f in part)

    def first_intact(self, candidates: List[str], fall_back: bool) -> str:
        """The first candidate whose files all match their checksums. With fall_back (resume=auto) a damaged one
        is skipped with a message naming it; otherwise it is an error."""
        skipped = []
        for path in candidates:
            bad = self.damaged(path)
            if not bad:
                return path
            why = f"{len(bad)} file(s) differ from what was saved (checksum), e.g. {bad[0]}"
            if not fall_back:
                raise CheckpointError(f"checkpoint {path} is damaged: {why}; resume from another one")
            self.logger.info(f"skipping checkpoint {path}: {why}")
            skipped.append(path)
        raise CheckpointError(f"no intact checkpoint to resume from: {', '.join(skipped)} are damaged; resume "
                              f"from an earlier copy, or start over with checkpoint.resume=none and "
                              f"checkpoint.overwrite=true")

    def resume(self, plan) -> Optional[str]:
        """Carry out a resume plan (trainer/checkpoint/resume_plan.py): load its checkpoint, or with resume=auto the
        newest intact one of its candidates; the path loaded (None: the plan loads nothing)."""
        if plan.path is None:
            return None
        path = self.first_intact([plan.path, *plan.fallbacks], fall_back=plan.falls_back)
        self.load(path, weights_only=plan.weights_only)
        return path

    def load(self, path: str, weights_only: bool) -> None:
        """Restore the run from a complete checkpoint (compatibility was checked before the process group
        started). With weights_only, only the model's weights: a new run starts from them at step 0."""
        meta = read_meta(path)
        verify_files(path, meta)
        try:
            saved = SavedCheckpoint(path, weights_only, meta["optim_param_groups"], meta.get("dp_size"),
                                    scratch_dir=self.root)
            self.strategy.load_checkpoint_from(saved, self.group)
        except (CheckpointError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise CheckpointError(f"cannot load checkpoint {path}: {one_line(e)}; it may be damaged, resume from "
                                  f"another one") from None
        if weights_only:
            self.logger.info(f"loaded the model weights of {path}; starting a new run at step 0")
            return
        self._load_states(path, meta)
        world_size = self.strategy.dims.world_size
        local_file = os.path.join(path, "local", f"rank_{self.rank}.pt")
        same_layout = meta["world_size"] == world_size and os.path.isfile(local_file)
        local = load_tensors(local_file, "rank state file") if same_layout else None
        for notice in [s.load_local_state(local) for s in self.rank_states]:  # in order: the worker's weights first
            if notice:
                self.logger.info(f"resume: {notice}")
        self.last_saved_step = self.progress.step
        change = "" if meta["world_size"] == world_size else \
            f" (saved at world size {meta['world_size']}, now {world_size})"
        self.logger.info(f"resumed from {path} at step {self.progress.step}{change}")

    def _load_states(self, path: str, meta: dict) -> None:
        """Every train state from meta.json (in the order given), then this rank's generators where the world size
        is the one they were saved at."""
        for name, state in self.states.items():
            if name != RNG and (name in meta or name != TRACKERS):
                state.load_state_dict(meta if name == PROGRESS else meta[name])
        rng_file = os.path.join(path, "rng", f"rank_{self.rank}.pt")
        if RNG in self.states and os.path.isfile(rng_file) and meta["world_size"] == self.strategy.dims.world_size:
            self.states[RNG].load_state_dict(load_tensors(rng_file, "RNG state file"))

    def close(self) -> None:
        self.wait()


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.item() if o.numel() == 1 else o.tolist()
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"cannot store {type(o).__name__} in meta.json")
