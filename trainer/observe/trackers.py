"""Experiment trackers (`logging.wandb`, `logging.mlflow`): what metrics.jsonl and eval.jsonl hold, sent on from rank 0.

A tracker receives the resolved config (W&B's config, MLflow's params), every metrics.jsonl and eval.jsonl record
at its own step with the same values (nested per-task figures flattened as "tasks/<name>/loss", as TensorBoard gets
them), the path of each complete checkpoint and, at the end, of the exported folders (W&B summary entries, MLflow
tags), and a final summary (`final/loss`, `final/val_loss`, `final/tokens`, `final/steps`). The metrics logger
(trainer/observe/metrics.py) is the one caller: the loop never sees a tracker.

One tracker run per training run. Each tracker's run id is saved with every checkpoint (meta.json's `trackers`
entry, a train state like the scheduler's) and, as records are sent, in `<run dir>/trackers.json`. A launch that
continues a run continues the same tracker run: a resume from a checkpoint (also one of another run directory, whose
tracker run then goes on), a restart (train.max_restarts) and an elastic re-formation take the checkpoint's id; a
launch that continues its run directory without a checkpoint (a restart before the first save) takes
trackers.json's. A new run (checkpoint.resume=none, or checkpoint.load_weights_only=true) starts new tracker runs.

No step is sent twice. A tracker's history cannot be rewritten, and a resumed run repeats the steps between its
checkpoint and where the interrupted attempt had got to. trackers.json records, per tracker run, the last metrics
step and the last evaluation step the tracker accepted (`metrics_through`, `eval_through`); a continuing launch
skips the records up to them (the marks of this run directory's trackers.json and of the checkpoint's run
directory's, for the same tracker run), and within a launch a step is never sent below one already sent. Exact
resume makes every skipped record equal to the one the tracker holds. (A resume that changes the training from an
earlier checkpoint leaves the tracker with the first values of the steps it already holds; metrics.jsonl has the
new ones.)

Failures never stop training: the trackers run in one background thread, so a slow or unreachable server never
holds a step up; an exception inside a tracker (network, disk, the library itself) is reported once on rank 0 and
that tracker is off for the rest of the launch. Asking for a tracker that is not installed is a config error
(`config_problems`, exit code 2, before any process group starts).

wandb and mlflow are optional dependencies: they are imported inside the tracker classes, only by a run that asks
for them (the one exception to the house rule of imports at a module's top).
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional
from urllib.parse import urlparse

from omegaconf import OmegaConf
from torch.distributed.checkpoint.stateful import Stateful

from tessera.errors import one_line

MARKS_FILE = "trackers.json"
METRICS, EVAL = "metrics_through", "eval_through"  # trackers.json: the last step of each kind a tracker accepted
START_WAIT_S = 120.0  # a checkpoint waits at most this long for a tracker's run id (its start still under way)
FINISH_WAIT_S = 300.0  # the end of a run waits at most this long for the trackers to send what they hold


@dataclass(frozen=True)
class TrackerSettings:
    """What the trackers take from the config and the run directory."""

    run_dir: str
    project: str  # logging.tracker_project: the W&B project, the MLflow experiment
    run_name: str
    mlflow_uri: Optional[str] = None  # logging.mlflow_tracking_uri


class Tracker:
    """One tracker. `start` (new or continued run), `log`, `note`, `finish` run in the trackers' thread; `state` (the
    run id a checkpoint keeps, {} before the start) may be read from any thread."""

    name = key = label = package = ""

    def start(self, config: dict, saved: dict, step: int) -> str:
        """Open a run: the one `saved` names (a state() of an earlier launch) if there is one, else a new one; returns
        a line for the log."""
        raise NotImplementedError

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        raise NotImplementedError

    def note(self, items: Dict[str, str]) -> None:
        raise NotImplementedError

    def finish(self, summary: Dict[str, float], step: int, ok: bool) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        raise NotImplementedError


class WandbTracker(Tracker):
    """Weights & Biases: history by step, the config, summary entries for notes. WANDB_MODE, WANDB_ENTITY,
    WANDB_DIR and the rest of W&B's environment apply; without WANDB_DIR the files go to <run dir>/wandb/."""

    name, key, label, package = "wandb", "logging.wandb", "W&B", "wandb"

    def __init__(self, settings: TrackerSettings):
        self.settings, self.run = settings, None

    def start(self, config: dict, saved: dict, step: int) -> str:
        import wandb  # optional dependency: imported by runs with logging.wandb=true only

        s, run_id = self.settings, saved.get("run_id")
        self.run = wandb.init(project=saved.get("project") or s.project, entity=saved.get("entity") or None,
                              id=run_id, resume="allow" if run_id else None, name=s.run_name,
                              dir=None if os.environ.get("WANDB_DIR") else s.run_dir,
                              config=None if run_id else config, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        if run_id:  # a resumed run may change values (train.max_steps, say): the config as this launch has it
            self.run.config.update(config, allow_val_change=True)
        where = f"offline in {os.path.dirname(self.run.dir)}" if self.run.offline else "online"
        return f"W&B run {self.run.id} ({'continued' if run_id else 'new'}, {where}, project {self.run.project})"

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        self.run.log(scalars, step=step)  # an evaluation and the metrics of one step make one row

    def note(self, items: Dict[str, str]) -> None:
        self.run.summary.update(items)

    def finish(self, summary: Dict[str, float], step: int, ok: bool) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if ok else 1)

    def state(self) -> dict:
        run = self.run
        return {} if run is None else {"run_id": run.id, "project": run.project, "entity": run.entity or None}


MLFLOW_PARAM_LIMIT = 6000  # characters of one param value (MLflow's MAX_PARAM_VAL_LENGTH)
MLFLOW_TAG_LIMIT = 5000
_MLFLOW_NAME = re.compile(r"[^\w\-. :/]")  # the characters MLflow allows in metric, param and tag names


class MlflowTracker(Tracker):
    """MLflow: metrics by step, the config as params, tags for notes. The store is logging.mlflow_tracking_uri,
    else $MLFLOW_TRACKING_URI, else a run continued from another run directory stays in that run's store (while it
    exists), else sqlite:///<run dir>/mlflow.db."""

    name, key, label, package = "mlflow", "logging.mlflow", "MLflow", "mlflow"

    def __init__(self, settings: TrackerSettings):
        self.settings, self.client, self.run_id, self.uri, self.experiment_id = settings, None, None, None, None

    def start(self, config: dict, saved: dict, step: int) -> str:
        import logging

        from mlflow.tracking import MlflowClient  # optional dependency: runs with logging.mlflow=true only

        for noisy in ("mlflow", "alembic"):  # the store's set-up logs at INFO level
            logging.getLogger(noisy).setLevel(logging.WARNING)
        self.uri = self._tracking_uri(saved)
        self.client = MlflowClient(self.uri)
        found = self._existing_run(saved.get("run_id"))
        params = flat_params(config)
        if found is None:
            self.experiment_id = self._experiment()
            run = self.client.create_run(self.experiment_id, run_name=self.settings.run_name,
                                         tags={"tessera.run_dir": os.path.abspath(self.settings.run_dir)})
            self.run_id = run.info.run_id
            self._params(params)
        else:
            self.run_id, self.experiment_id = found.info.run_id, found.info.experiment_id
            self.client.update_run(self.run_id, status="RUNNING")
            self._changed_params(found.data.params, params, step)
        return f"MLflow run {self.run_id} ({'continued' if found else 'new'}, {self.uri})"

    def _tracking_uri(self, saved: dict) -> str:
        configured = self.settings.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if configured:
            return configured
        previous = saved.get("tracking_uri")
        if previous and _local_store_present(previous):
            return previous
        return "sqlite:///" + os.path.abspath(os.path.join(self.settings.run_dir, "mlflow.db"))

    def _existing_run(self, run_id: Optional[str]):
        """The run to continue, or None when there is none or the store does not hold it."""
        from mlflow.exceptions import MlflowException  # optional dependency

        if not run_id:
            return None
        try:
            return self.client.get_run(run_id)
        except MlflowException as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def _experiment(self) -> str:
        name = self.settings.project
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # A local store keeps artifacts beside it (none are logged; MLflow's default is a folder in the working
        # directory); a server decides for itself.
        store = _local_path(self.uri)
        artifacts = None if store is None else "file://" + os.path.join(os.path.dirname(os.path.abspath(store)),
                                                                        "mlartifacts")
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except Exception:  # noqa: BLE001 - another job created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _params(self, params: Dict[str, str]) -> None:
        from mlflow.entities import Param  # optional dependency

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def _changed_params(self, logged: Dict[str, str], params: Dict[str, str], step: int) -> None:
        """A continued run: new keys as params; a changed value (MLflow refuses to change a param) in a tag."""
        self._params({k: v for k, v in params.items() if k not in logged})
        changed = [f"{k}={v} (was {logged[k]})" for k, v in params.items() if k in logged and logged[k] != v]
        if changed:
            self.note({f"resumed_at_step_{step}": "; ".join(changed)})

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional dependency

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", k), float(v), now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def note(self, items: Dict[str, str]) -> None:
        from mlflow.entities import RunTag  # optional dependency

        tags = [RunTag(_MLFLOW_NAME.sub("_", k), str(v)[:MLFLOW_TAG_LIMIT]) for k, v in items.items()]
        self.client.log_batch(self.run_id, tags=tags)

    def finish(self, summary: Dict[str, float], step: int, ok: bool) -> None:
        if summary:
            self.log(step, summary)
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")

    def state(self) -> dict:
        if self.run_id is None:
            return {}
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.uri}


TRACKERS = (WandbTracker, MlflowTracker)


def _local_path(uri: str) -> Optional[str]:
    """The file or folder of a local store (sqlite:///path, file:///path, a bare path); None for a server."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        return uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if parsed.scheme in ("file", ""):
        return parsed.path
    return None


def _local_store_present(uri: str) -> bool:
    path = _local_path(uri)
    return path is None or os.path.exists(path)


def flat_params(config: dict, prefix: str = "") -> Dict[str, str]:
    """A nested config as MLflow params: "train.max_steps" -> "6" (values cut at MLflow's limit)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[_MLFLOW_NAME.sub("_", f"{prefix}{k}")] = str(v)[:MLFLOW_PARAM_LIMIT]
    return out


def config_problems(cfg) -> List[str]:
    """A tracker that is asked for and not installed (one problem naming the key), before any process group."""
    problems = []
    for cls in TRACKERS:
        if getattr(cfg.logging, cls.name) and not installed(cls.package):
            problems.append(f"{cls.key}=true needs the {cls.package} package, which is not installed: pip install "
                            f"{cls.package} (or the project's trackers extra), or set {cls.key}=false")
    if (cfg.logging.wandb or cfg.logging.mlflow) and not cfg.logging.tracker_project.strip():
        problems.append("logging.tracker_project must name the W&B project / MLflow experiment (it is empty)")
    return problems


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that fails to import, a module without a spec
        return False


def open_trackers(cfg, run_dir: str, rank0: bool) -> "Trackers":
    """The run's trackers (logging.wandb / logging.mlflow) on rank 0, with the resolved config; none elsewhere."""
    log = cfg.logging
    chosen = [cls for cls in TRACKERS if getattr(log, cls.name)]
    if not rank0 or not chosen:
        return Trackers()
    name = log.tracker_run_name or "/".join(os.path.abspath(run_dir).split(os.sep)[-2:])
    settings = TrackerSettings(run_dir, log.tracker_project, name, log.mlflow_tracking_uri)
    config = OmegaConf.to_container(OmegaConf.structured(cfg))
    return Trackers([cls(settings) for cls in chosen], run_dir, config)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Worker:
    """One daemon thread that runs the trackers' calls in the order given. A call that raises turns its tracker off
    for the rest of the launch, with one message: a tracker never stops training."""

    def __init__(self, warn: Callable[[str], None]):
        self.queue: "queue.Queue" = queue.Queue()
        self.failed: set = set()
        self.warn = warn
        self.thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        self.thread.start()

    def submit(self, tracker: Optional[Tracker], fn: Callable[[], None]) -> None:
        self.queue.put((tracker, fn))

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            tracker, fn = item
            if tracker is not None and tracker.name in self.failed:
                continue
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - anything a tracker raises: reported once, that tracker off
                if tracker is None:
                    continue
                self.failed.add(tracker.name)
                self.warn(f"{tracker.key}: {tracker.label} failed ({one_line(e)[:300]}); training goes on without "
                          f"it (metrics.jsonl and eval.jsonl hold every record)")

    def close(self, timeout: float) -> bool:
        """Run what is queued, then end the thread; False when it is still busy after `timeout` seconds."""
        self.queue.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()


def read_marks(run_dir: Optional[str]) -> dict:
    """trackers.json of a run directory ({} when there is none or it does not parse)."""
    if not run_dir:
        return {}
    try:
        with open(os.path.join(run_dir, MARKS_FILE)) as fh:
            marks = json.load(fh)
        return marks if isinstance(marks, dict) else {}
    except (OSError, ValueError):
        return {}


def checkpoint_run_dir(checkpoint: Optional[str]) -> Optional[str]:
    """The run directory of a checkpoint folder <run dir>/checkpoints/step_<N> (None for one elsewhere)."""
    if not checkpoint:
        return None
    parent = os.path.dirname(os.path.abspath(checkpoint))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def held_through(name: str, run_id: Optional[str], sources: List[dict]) -> Dict[str, int]:
    """The last metrics and evaluation steps tracker run `run_id` holds, by the trackers.json files `sources`
    (-1: none known)."""
    marks = {METRICS: -1, EVAL: -1}
    if not run_id:
        return marks
    for source in sources:
        entry = source.get(name)
        if isinstance(entry, dict) and entry.get("run_id") == run_id:
            for kind in marks:
                if isinstance(entry.get(kind), int):
                    marks[kind] = max(marks[kind], entry[kind])
    return marks


class Trackers(Stateful):
    """The run's trackers behind one interface (rank 0; other ranks and runs without a tracker hold one with none):
    `start`, `log_metrics`, `log_eval`, `note`, `finish`, and the train state a checkpoint keeps (`state_dict`:
    each tracker's run; what a checkpoint held for a tracker that is off in this launch is kept as it was)."""

    def __init__(self, trackers=(), run_dir: str = "", config: Optional[dict] = None,
                 say: Callable[[str], None] = _stderr):
        self.trackers: List[Tracker] = list(trackers)
        self.run_dir, self.config, self.say = run_dir, config or {}, say  # say: rank 0's console
        self.loaded: Dict[str, dict] = {}  # meta.json's entry of the checkpoint this launch resumed
        self.sent: Dict[str, Dict[str, int]] = {}  # per tracker the last step of each kind sent (or held already)
        self.marks: Dict[str, dict] = {}  # trackers.json as the trackers confirm (written by the worker only)
        self.eval_keys = (-1, frozenset())  # the last evaluation's step and keys: its metrics record repeats them
        self.worker: Optional[_Worker] = None
        self.started = threading.Event()

    # ---- the train state a checkpoint keeps ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.worker is not None:
            self.started.wait(START_WAIT_S)  # the run ids exist once the trackers have started
        out = dict(self.loaded)
        for tracker in self.trackers:
            state = tracker.state()
            if state:
                out[tracker.name] = state
        return out

    def load_state_dict(self, state: dict) -> None:
        self.loaded = {k: dict(v) for k, v in (state or {}).items() if isinstance(v, dict)}

    # ---- the run ---------------------------------------------------------------------------------------------------
    def start(self, step: int, continues: bool, checkpoint: Optional[str] = None) -> None:
        """Open every tracker's run at `step`: the run the resumed checkpoint names, else (`continues`: this launch
        continues its run directory) the one trackers.json names, else a new one. Records up to what the run holds
        already are skipped from here on (see the module's docstring)."""
        if not self.trackers or self.worker is not None:
            return
        here = read_marks(self.run_dir) if continues else {}
        sources = [here, read_marks(checkpoint_run_dir(checkpoint))]
        self.marks = {k: v for k, v in here.items() if isinstance(v, dict)}  # a tracker off now keeps its entry
        self.worker = _Worker(self.say)
        for tracker in self.trackers:
            saved = self.loaded.get(tracker.name) or here.get(tracker.name) or {}
            saved = saved if isinstance(saved, dict) else {}
            held = held_through(tracker.name, saved.get("run_id"), sources)
            self.sent[tracker.name] = dict(held)
            self.worker.submit(tracker, lambda t=tracker, s=saved, h=held: self._open(t, s, step, h))
        self.worker.submit(None, self.started.set)

    def _open(self, tracker: Tracker, saved: dict, step: int, held: Dict[str, int]) -> None:
        line = tracker.start(self.config, saved, step)
        skip = max(held.values())
        held_note = f"; it holds steps up to {skip}, which are not sent again" if skip > step else ""
        self.say(f"tracking with {line}{held_note}")
        self.marks[tracker.name] = {**tracker.state(), **held}
        self._write_marks()

    def log_metrics(self, step: int, scalars: Dict[str, float]) -> None:
        """A metrics.jsonl record (flattened); what the evaluation of this step sent already is left out."""
        at, keys = self.eval_keys
        self._send(METRICS, step, {k: v for k, v in scalars.items() if at != step or k not in keys})

    def log_eval(self, step: int, scalars: Dict[str, float]) -> None:
        """An eval.jsonl record (flattened)."""
        self.eval_keys = (step, frozenset(scalars))
        self._send(EVAL, step, scalars)

    def _send(self, kind: str, step: int, scalars: Dict[str, float]) -> None:
        if self.worker is None or not scalars:
            return
        for tracker in self.trackers:
            sent = self.sent[tracker.name]
            if step <= sent[kind]:
                continue  # the tracker run holds this step already: not twice (the module's docstring)
            sent[kind] = step
            self.worker.submit(tracker, lambda t=tracker, k=kind: self._log(t, k, step, scalars))

    def _log(self, tracker: Tracker, kind: str, step: int, scalars: Dict[str, float]) -> None:
        tracker.log(step, scalars)
        marks = self.marks.setdefault(tracker.name, tracker.state())
        marks[kind] = max(marks.get(kind, -1), step)
        self._write_marks()

    def _write_marks(self) -> None:
        path = os.path.join(self.run_dir, MARKS_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(self.marks, fh, indent=1)
        os.replace(tmp, path)

    def note(self, items: Dict[str, str]) -> None:
        """Paths worth finding from the tracker (checkpoints, exports): W&B summary entries, MLflow tags."""
        if self.worker is not None and items:
            for tracker in self.trackers:
                self.worker.submit(tracker, lambda t=tracker: t.note(dict(items)))

    def finish(self, summary: Dict[str, float], step: int, ok: bool) -> None:
        """The final summary, each run closed (finished, or failed when `ok` is false); waits for what is queued."""
        if self.worker is None:
            return
        for tracker in self.trackers:
            self.worker.submit(tracker, lambda t=tracker: t.finish(dict(summary), step, ok))
        worker, self.worker = self.worker, None
        if not worker.close(FINISH_WAIT_S):
            self.say(f"the trackers are still sending after {FINISH_WAIT_S:.0f} s; leaving them (metrics.jsonl and "
                     f"eval.jsonl hold every record)")
