"""ParallelDims: the one validated object that owns the parallel degrees, the world size and the device mesh.

Code asks `dp_enabled`, `tp_enabled`, ... and never compares degrees itself. `-1` in one degree fills the
ranks the others leave. Also: device selection and process-group start-up (backend follows the device).
"""
from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from tessera.errors import ConfigError, FaultError, TesseraError

DEGREE_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    # Context parallelism: each sequence split over `cp` ranks that hold the same batch (its ranks are not
    # data-parallel: the global batch is split dp_size ways, not dp_size x cp).
    cp: int = 1
    # Expert parallelism borrows ranks: the experts are split over `ep` of the dp_shard x cp ranks (which still read
    # their own batches); it adds no ranks of its own.
    ep: int = 1
    # torchft replica groups (strategy.fault_tolerance=torchft): this process group is group `replica_group` of
    # `replica_groups` equal ones, each taking its share of the global batch.
    replica_groups: int = 1
    replica_group: int = 0

    @classmethod
    def from_config(cls, strategy_cfg, world_size: int) -> "ParallelDims":
        problems = cls.problems(strategy_cfg, world_size)
        if problems:
            raise ConfigError(problems)
        degrees = {k: getattr(strategy_cfg, k, 1) for k in DEGREE_KEYS}
        fill = [k for k, v in degrees.items() if v == -1]
        if fill:
            known = 1
            for k, v in degrees.items():
                if v != -1:
                    known *= v
            degrees[fill[0]] = world_size // known
        groups = {"ep": getattr(strategy_cfg, "ep", 1)}
        if getattr(strategy_cfg, "fault_tolerance", "none") == "torchft":
            groups.update(replica_groups=strategy_cfg.replica_groups, replica_group=max(strategy_cfg.replica_group, 0))
        return cls(world_size=world_size, **degrees, **groups)

    @staticmethod
    def problems(strategy_cfg, world_size: int) -> List[str]:
        degrees = {k: getattr(strategy_cfg, k, 1) for k in DEGREE_KEYS}
        problems = []
        for k, v in degrees.items():
            if k == "cp" and v < 1:  # a sequence is split a chosen number of ways, never "what is left"
                problems.append(f"strategy.cp={v} must be a positive degree (1: no context parallelism)")
            elif v == 0 or v < -1:
                problems.append(f"strategy.{k}={v} must be a positive degree or -1 (fill the remaining ranks)")
        fill = [k for k, v in degrees.items() if v == -1]
        if len(fill) > 1:
            problems.append(f"only one degree may be -1, got {', '.join('strategy.' + k for k in fill)}")
        if problems:
            return problems
        known = 1
        for v in degrees.values():
            if v != -1:
                known *= v
        desc = " x ".join(f"strategy.{k}={v}" for k, v in degrees.items() if k != "cp" or v != 1)
        if fill:
            if world_size % known:
                problems.append(f"world size {world_size} is not divisible by the fixed degrees ({desc}); change "
                                f"the degrees or the number of processes")
        elif known != world_size:
            problems.append(f"the parallel degrees multiply to {known} ({desc}) but the world size is {world_size}; "
                            f"change the degrees or the number of processes")
        return problems or _ep_problems(strategy_cfg, degrees, world_size // known if fill else 1)

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def group_dp_size(self) -> int:
        """Data-parallel ranks in this process group."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the whole job (every replica group's): the global batch is split this many ways."""
        return self.group_dp_size * self.replica_groups

    @property
    def dp_enabled(self) -> bool:
        return self.group_dp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def mesh_shape(self):
        """(names, sizes) of the mesh, outermost first: pp, dp_replicate, dp_shard, cp, tp (tensor-parallel
        ranks innermost, the busiest links; the context ranks of one sequence next to them)."""
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return names, sizes

    def build_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = self.mesh_shape()
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)

    def dp_coordinates(self, rank: int):
        """(dp_rank, dp_size) of a rank of this process group under the mesh layout above (replica groups follow
        one another: group g holds data-parallel ranks g x group_dp_size onwards)."""
        dp_rank = (rank // (self.tp * self.cp)) % self.group_dp_size
        return self.replica_group * self.group_dp_size + dp_rank, self.dp_size


def _ep_problems(strategy_cfg, degrees: dict, filled: int) -> List[str]:
    """strategy.ep: a positive degree dividing the ranks it borrows (dp_shard x cp, once -1 is filled)."""
    ep = getattr(strategy_cfg, "ep", 1)
    if ep < 1:
        return [f"strategy.ep={ep} must be a positive degree (1: no expert parallelism)"]
    shard = degrees["dp_shard"] if degrees["dp_shard"] != -1 else filled
    if (shard * degrees["cp"]) % ep:
        return [f"strategy.ep={ep} splits the experts over data-parallel shard (x context) ranks: it must divide "
                f"strategy.dp_shard x strategy.cp = {shard * degrees['cp']}"]
    return []


# ----------------------------------------------------------------------------------------------------------
# Environment: rank, device, process group.

def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def env_spans_nodes() -> bool:
    """Several nodes, each with a launcher of its own: more ranks than this node's (torchrun's LOCAL_WORLD_SIZE,
    DeepSpeed's LOCAL_SIZE)."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return bool(local) and env_world_size() > int(local)


def device_type(spec: str) -> str:
    """The device type `select_device(spec)` will choose, without choosing it (checks before any group)."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(spec).type


def select_device(spec: str) -> torch.device:
    """auto: the local rank's CUDA device when CUDA is available, else CPU."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(["train.device=cuda but no CUDA device is available; use train.device=auto or cpu"])
        spec = f"cuda:{env_local_rank() % torch.cuda.device_count()}"
    device = torch.device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


# Ports handed out here lie below the kernel's ephemeral range: a port the kernel picked for bind(0) is free only
# until the kernel hands it to the next outgoing connection, and every gloo/NCCL pair connection takes one, so a
# launcher starting seconds later could find its port taken by another run's collectives.
PORT_FLOOR = 15000


def ephemeral_port_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A local TCP port nobody holds, chosen at random below the ephemeral range (the kernel's own pick when
    that range is too narrow or every try is taken)."""
    low = ephemeral_port_range()[0]
    if low - PORT_FLOOR >= 1000:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(PORT_FLOOR, low)
            if port_is_free(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLLECTIVE_TIMEOUT_S = None  # train.collective_timeout_s of the started group (named in timeout messages)


def init_process_group(device: torch.device, timeout_s: float) -> None:
    """Start the default process group: nccl on CUDA, gloo on CPU. A single process started with plain
    `python` (no WORLD_SIZE from a launcher) gets a one-rank group on a free local port, whatever MASTER_ADDR /
    MASTER_PORT the shell exports (a one-rank group meets no one). A MASTER_PORT in use or ranks that never
    arrive become one message naming the port or train.collective_timeout_s."""
    global COLLECTIVE_TIMEOUT_S
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    COLLECTIVE_TIMEOUT_S = timeout_s
    timeout = datetime.timedelta(seconds=timeout_s)
    bound_later_groups(timeout)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store across restarts (static rendezvous, `torchrun --max-restarts`): the
            # keys of a failed attempt (its ranks' addresses) are still there, and a restarted rank would read
            # them and dial dead peers. Each attempt gets keys of its own.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"/tessera/attempt_{attempt}",
                                     dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                   is_master=False, timeout=timeout))
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    except (RuntimeError, ValueError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        problem = start_problem(e, timeout_s)
        if problem is None:
            raise
        raise problem from None


def bound_later_groups(timeout: datetime.timedelta) -> None:
    """Every process group created after the default one gets `timeout` too: DCP's checkpoint group, the stop
    flag's group, DeviceMesh's sub-groups and DeepSpeed's groups are made by `new_group` without a timeout, which
    torch fills with its own default (30 minutes for gloo, 10 for NCCL) read from these two module attributes.
    Without this a rank that stops during a save or an evaluation held its peers for half an hour."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def port_in_use_message(port, addr: str = "") -> str:
    where = f" on {addr}" if addr else ""
    return (f"MASTER_PORT={port} is already in use{where} (another run or program listens on it); pick a free port "
            f"(MASTER_PORT=<port>, torchrun/deepspeed --master_port) or, with launch.sh on one node, leave "
            f"MASTER_PORT unset")


def start_problem(e: BaseException, timeout_s: float):
    """The user-facing error for a process group that could not start, or None (not a known cause)."""
    text = str(e)
    low = text.lower()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if "eaddrinuse" in low or "address already in use" in low:
        return TesseraError(port_in_use_message(port, addr))
    if "timed out" in low or "timeout" in low:
        return FaultError(f"the process group did not start within train.collective_timeout_s={timeout_s:g} "
                          f"seconds: not every rank reached MASTER_ADDR={addr}:MASTER_PORT={port} (check that every "
                          f"node started with the same MASTER_ADDR/MASTER_PORT, NNODES and NPROC_PER_NODE)")
    if ("master_addr" in low or "master_port" in low) and "expected" in low:
        return TesseraError(f"the launcher left {text.split('expected')[0].strip() or 'MASTER_ADDR/MASTER_PORT'} "
                            f"unset; set MASTER_ADDR and MASTER_PORT (or start with torchrun / launch.sh)")
    return None


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    return (dist.get_rank() if dist.is_initialized() else env_rank()) == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
