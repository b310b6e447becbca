"""Fault-tolerant replica groups with torchft (`strategy.fault_tolerance=torchft`).

The job is `strategy.replica_groups` groups of equal layout, each its own torchrun job whose ranks run DDP or
FSDP2 (strategy=hsdp: sharded inside the group) among themselves on the default process group. A torchft
lighthouse forms a quorum of the live groups before every step; rank r of each group all-reduces its gradient
(group-reduced; a DTensor's local shard) with rank r of the others through torchft's Manager, which reconfigures
that process group whenever the quorum changes. A group that dies is left out of the next quorum and the others
train on; a group that (re)starts copies the current weights, optimizer state, scheduler and step counters from
a live one (torchft's checkpoint transport) before its first step and then takes part.

Normalisation follows the participating tokens: every rank computes its gradient as its token-loss sum divided
by the global batch's target tokens (the loop's rule); the cross-group reduction sums gradients, token-loss sums
and target-token counts of the groups in the quorum and rescales the gradient by (global tokens / participating
tokens). With every group present the scale is exactly 1 and the step equals plain DDP over all ranks; while a
group is missing, its share of the batch is dropped and the step is the mean over the tokens that were trained.

torchft's Manager keeps its own step counter: it is set from the run's step before the first quorum (a resumed
run) and moves with every committed step. A step the groups could not agree on (a peer died inside the
all-reduce) is not committed: the loop runs it again after the next quorum.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
import warnings
from typing import Callable, Dict, List
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from tessera.errors import FaultError, TesseraError, one_line
from trainer.data.datasets import IGNORE
from trainer.observe import comm_bytes

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
START_WAIT_S = 60  # how long a group waits for the others before its first step


def lighthouse_address(strategy_cfg) -> str:
    return strategy_cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def config_problems(cfg) -> List[str]:
    """Checks of the torchft keys that need no process group (the strategy adds them to its config problems)."""
    s = cfg.strategy
    if s.fault_tolerance != "torchft":
        return []
    problems = []
    try:
        _import_torchft()
    except ImportError:
        return ["strategy.fault_tolerance=torchft needs the torchft package (pip install torchft); it is not "
                "installed"]
    if s.replica_groups > 1 and not 0 <= s.replica_group < s.replica_groups:
        problems.append(f"strategy.replica_group={s.replica_group} must name this job's group, 0.."
                        f"{s.replica_groups - 1} (strategy.replica_groups={s.replica_groups}); launch.sh sets it for "
                        f"each group it starts")
    if s.min_replica_groups > s.replica_groups:
        problems.append(f"strategy.min_replica_groups={s.min_replica_groups} exceeds strategy.replica_groups="
                        f"{s.replica_groups}: no step could ever be taken")
    address = lighthouse_address(s)
    if address and not _host_port(address):
        problems.append(f"strategy.lighthouse={address!r} is not an address like http://host:29510")
    if not address:
        problems.append(f"strategy.fault_tolerance=torchft needs a lighthouse: set strategy.lighthouse=http://host:"
                        f"port (or ${LIGHTHOUSE_ENV}), or start through launch.sh, which runs one")
    return problems


def _import_torchft():
    """torchft, with its logs quiet: it logs every quorum and commit (Rust and Python, INFO); ReplicaGroups says
    what changes, once. Its Rust logger reads RUST_LOG when the module loads."""
    os.environ.setdefault("RUST_LOG", "warn")
    # Its checkpoint transport reads a peer's tensors from a read-only buffer (copied before use).
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    import torchft

    return torchft


def _host_port(address: str):
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        return None
    return (parsed.hostname, port) if parsed.hostname and port else None


def check_lighthouse(strategy_cfg, timeout_s: float = 5.0) -> None:
    """A lighthouse that cannot be reached is an error at start-up, not a hang in the first quorum."""
    address = lighthouse_address(strategy_cfg)
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        key = "strategy.lighthouse" if strategy_cfg.lighthouse else f"${LIGHTHOUSE_ENV}"
        why = e.strerror or one_line(e)
        raise TesseraError(f"the torchft lighthouse at {address} ({key}) cannot be reached ({why}); "
                         f"start it (torchft_lighthouse --min_replicas 1) or fix the address",
                         same_on_every_rank=True) from None  # every rank dials the same address


# ---- the state a recovering group copies: local tensors only (a DTensor's shard; every group has the same layout,
# so rank r of one group holds the shards rank r of another needs) ------------------------------------------------
def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_tensors(state: dict) -> dict:
    return {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@torch.no_grad()
def copy_into_module(module, state: dict) -> None:
    """Write a peer's module state (local tensors) into this module's parameters and buffers, in place."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise TesseraError(f"the live replica group's model state lacks {missing[:3]}: do the groups run the same "
                           f"model and config?")
    for k, v in own.items():
        _local(v).copy_(state[k])


def local_optimizer_state(optimizer) -> dict:
    state = optimizer.state_dict()
    return {"state": {i: local_tensors(entry) for i, entry in state["state"].items()},
            "param_groups": state["param_groups"]}


def load_optimizer_state(optimizer, state: dict) -> None:
    """A peer's optimizer state (local tensors) into this optimizer: entries of DTensor parameters become DTensors
    laid out like their parameter (a group that starts fresh has no state of its own to copy into)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    entries = {}
    for index, entry in state["state"].items():
        p = params[int(index)]
        if isinstance(p, DTensor):
            local_shape = p.to_local().shape
            entry = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                     if isinstance(v, torch.Tensor) and v.shape == local_shape and v.dim() > 0 else v
                     for k, v in entry.items()}
        entries[index] = entry
    optimizer.load_state_dict({"state": entries, "param_groups": state["param_groups"]})


def group_run_dir(cfg, run_dir: str) -> str:
    """Each group is its own job with its own checkpoints and logs: `<run dir>/replica_group_<g>`."""
    s = cfg.strategy
    if s.fault_tolerance != "torchft" or s.replica_groups == 1:
        return run_dir
    return os.path.join(run_dir, f"replica_group_{max(s.replica_group, 0)}")


class ReplicaGroups:
    """This rank's torchft Manager: quorum before each step, the cross-group gradient reduction, the commit."""

    def __init__(self, cfg, device: torch.device):
        _import_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        s = cfg.strategy
        self.groups, self.group = s.replica_groups, max(s.replica_group, 0)
        self.lighthouse = lighthouse_address(s)
        timeout = datetime.timedelta(seconds=cfg.train.collective_timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._shared: Dict[str, tuple] = {}
        host, port = self._group_store()
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=s.min_replica_groups,
            use_async_quorum=False,  # a recovering group loads the peer's state before its forward, not after
            timeout=timeout, quorum_timeout=timeout, connect_timeout=datetime.timedelta(seconds=10),
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            store_addr=host, store_port=port, lighthouse_addr=self.lighthouse,
            replica_id=f"tessera_group_{self.group}", init_sync=True)
        self.participants = 0
        self.committed = True
        self.loss_sum = self.tokens = None
        self._synced_step = False

    def _group_store(self):
        """A store of this group's own for the Manager's keys, new for every start: torchrun's agent store outlives
        a restarted attempt and would hand out the dead attempt's manager address."""
        # The other groups reach this store too (their rank r meets ours there): a loopback MASTER_ADDR (one-node
        # torchrun) is advertised as this host's name, as torchft advertises its manager's address.
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if host in ("localhost", "127.0.0.1", "::1"):
            host = socket.gethostname()
        self._store = None
        port = [0]
        if not dist.is_initialized() or dist.get_rank() == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = [self._store.port]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(port, src=0)
        return host, port[0]

    def share_state(self, key: str, state_dict: Callable[[], object], load_state_dict: Callable[[object], None]):
        """State a recovering group copies from a live one (model, optimizer, scheduler, counters). Registered with
        torchft before the first quorum, "identity" first: a group that trains something else is refused before
        any of its state is overwritten."""
        self._shared[key] = (load_state_dict, state_dict)

    def begin_step(self, step: int) -> None:
        """Quorum for the next step; a group behind the others (new, restarted) loads their state here."""
        if not self._synced_step:  # a resumed run: torchft counts from the run's step
            self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})
            for key in sorted(self._shared, key=lambda k: k != "identity"):
                self.manager.register_state_dict_fn(key, *self._shared[key])
            self._synced_step = True
        before = self.participants
        self._quorum()
        if before == 0 and self.participants < self.groups:
            self._wait_for_groups()
        if self.manager.current_step() != step:
            self._say(f"recovered from a live group: weights, optimizer and run state of step "
                      f"{self.manager.current_step()} (this group was at step {step})")
        if self.participants != before:
            self._say(f"{self.participants} of {self.groups} replica groups train from step "
                      f"{self.manager.current_step() + 1}")

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()
            self.participants = self.manager.num_participants()
        except TesseraError:  # this group cannot take the live groups' state (another run): said as it is
            raise
        except Exception as e:  # noqa: BLE001 - torchft raises what its RPCs raise
            raise FaultError(f"replica group {self.group}: no quorum from the torchft lighthouse at "
                             f"{self.lighthouse} ({one_line(e)[:200]}); is it still running?") from None

    def _wait_for_groups(self) -> None:
        """Groups started together begin together: before its first step a group asks for new quorums (each waits
        up to the lighthouse's join timeout for groups that are starting) until every group is in or
        START_WAIT_S have passed; then it trains with the groups there are (the others join later, recovering
        from a live group). Counted in quorums, not seconds: every rank of the group runs the same loop."""
        self._say(f"{self.participants} of {self.groups} replica groups here; waiting up to {START_WAIT_S} s for "
                  f"the others")
        for _ in range(int(START_WAIT_S / 0.5)):
            if self.participants >= self.groups:
                break
            time.sleep(0.5)
            self._quorum()

    def reduce(self, grads: List[torch.Tensor], loss_sum: torch.Tensor, tokens: float, n_target: int):
        """Sum the participating groups' gradients, token-loss sums and target tokens (one all-reduce per rank),
        then rescale the gradient from the global batch's tokens to the participating ones."""
        from torch.distributed import ReduceOp

        grads = [_local(g) for g in grads]  # a DTensor's shard: the same shard on rank r of every group
        device = grads[0].device if grads else loss_sum.device
        flat = torch.cat([g.reshape(-1).float() for g in grads]
                         + [loss_sum.reshape(1).float().to(device), torch.tensor([float(tokens)], device=device)])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        comm_bytes.COUNTER.add("all_reduce", comm_bytes.tensor_bytes(flat))  # torchft's own process group
        totals = flat[-2:].clone()
        if dist.is_initialized() and dist.get_world_size() > 1:  # the group's ranks: their shares of the batch
            dist.all_reduce(totals)
        self.loss_sum, self.tokens = float(totals[0]), float(totals[1])
        scale = n_target / self.tokens if self.tokens > 0 else 0.0
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g).mul_(scale))
            offset += n

    def commit(self) -> bool:
        """Whether every rank of this group may step (no error in the quorum's collectives, enough groups)."""
        self.committed = self.manager.should_commit()
        if not self.committed:
            error = self.manager.errored()
            self._say(f"step {self.manager.current_step() + 1} not committed"
                      + (f": {str(error.original_exception).splitlines()[0][:200]}" if error else ""))
        return self.committed

    def _say(self, msg: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[replica group {self.group}] {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self._store = None


class FaultTolerance:
    """torchft replica groups around the training loop (torchtitan's FTManager pattern), owned by the run: the
    quorum before each step (a recovering group first copies the model, optimizer, loss scaler and every state
    shared with `share_state` from a live group), the live groups' gradients summed before the strategy steps
    (normalised by the target tokens they trained), and whether the step was committed."""

    def __init__(self, cfg, strategy):
        self.groups = ReplicaGroups(cfg, strategy.device)
        model, optimizer = strategy.unwrapped(), strategy.optimizer
        self.share_state("model", lambda: local_tensors(model.state_dict()),
                         lambda state: copy_into_module(model, state))
        self.share_state("optimizer", lambda: local_optimizer_state(optimizer),
                         lambda state: load_optimizer_state(optimizer, state))
        self.share_state("precision", strategy.precision.state_dict, strategy.precision.load_state_dict)

    def share_state(self, key: str, state_dict, load_state_dict) -> None:
        """Run state (scheduler, progress) that a recovering replica group copies from a live one."""
        self.groups.share_state(key, state_dict, load_state_dict)

    def begin_step(self, step: int) -> None:
        """Before step `step`'s batch is read: the quorum, which may move the run's step (a recovering group)."""
        self.groups.begin_step(step)

    def optimizer_step(self, strategy, loss_sum, micro_batches, num_target_tokens: int, max_norm: float):
        """Sum the live groups' gradients, then the strategy's step -> (norm, skipped); when the groups cannot
        commit (one failed during the step), no update: committed() is then False and the step runs again."""
        tokens = sum(int((b["labels"] != IGNORE).sum()) for b in micro_batches)
        grads = [p.grad for p in strategy.unwrapped().parameters() if p.grad is not None]
        self.groups.reduce(grads, loss_sum, tokens, num_target_tokens)
        if not self.groups.commit():
            strategy.optimizer.zero_grad(set_to_none=True)
            return torch.zeros((), dtype=torch.float64), False
        return strategy.optimizer_step(max_norm)

    def committed(self) -> bool:
        return self.groups.committed

    def trained_tokens(self, num_target_tokens: int) -> int:
        """Target tokens the last step trained on (fewer than the global batch's while a group is down)."""
        return int(self.groups.tokens)

    def step_loss(self, strategy, loss_sum, num_target_tokens: int) -> float:
        return self.groups.loss_sum / max(self.groups.tokens, 1.0)

    def metrics(self) -> dict:
        return {"replica_groups": self.groups.participants}

    def close(self) -> None:
        self.groups.close()


class NoFaultTolerance:
    """The same surface without replica groups: every step is the strategy's and is committed."""

    def share_state(self, key: str, state_dict, load_state_dict) -> None:
        pass

    def begin_step(self, step: int) -> None:
        pass

    def optimizer_step(self, strategy, loss_sum, micro_batches, num_target_tokens: int, max_norm: float):
        return strategy.optimizer_step(max_norm)

    def committed(self) -> bool:
        return True

    def trained_tokens(self, num_target_tokens: int) -> int:
        return num_target_tokens

    def step_loss(self, strategy, loss_sum, num_target_tokens: int) -> float:
        """The step's loss: token cross-entropy over the global batch (a collective, on log steps)."""
        return strategy.dp_sum(loss_sum).item() / num_target_tokens

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def fault_tolerance(cfg, strategy):
    """The run's fault-tolerance manager, made once the strategy is set up."""
    return FaultTolerance(cfg, strategy) if cfg.strategy.fault_tolerance == "torchft" else NoFaultTolerance()
