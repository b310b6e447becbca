"""A real two-node SLURM cluster on this machine for the tests: Debian's slurm-wlm and munge (installed with apt
where missing), one slurmctld and two slurmd daemons (`slurmd -N n1`, `slurmd -N n2`, NodeAddr 127.0.0.1, ports of
their own, SlurmdParameters=config_overrides so that each node may claim more CPUs than the machine has).

Everything the cluster writes (config, state, spool, logs) lives in one folder; `SlurmCluster.env()` is the
environment (SLURM_CONF) that sbatch, srun, scontrol and squeue need. `stop()` cancels the jobs and stops the
daemons it started (and munged, when it started it)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import List, Optional

from trainer.parallel.dims import free_port

PACKAGES = ["slurm-wlm", "munge"]
TOOLS = ["sbatch", "srun", "scontrol", "squeue", "slurmctld", "slurmd", "munged", "munge"]


class ClusterError(RuntimeError):
    pass


def _run(cmd: List[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def install() -> None:
    """apt-get install slurm-wlm and munge when a tool is missing (as root, or through sudo)."""
    if all(shutil.which(t) or os.path.exists(f"/usr/sbin/{t}") for t in TOOLS):
        return
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None:
        raise ClusterError(f"SLURM is not installed and this user cannot install it: apt-get install {PACKAGES}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = _run(sudo + ["apt-get", "install", "-y", "-q", *PACKAGES], env=env)
    if proc.returncode != 0:  # a fresh machine: the package lists first
        _run(sudo + ["apt-get", "update", "-q"], env=env)
        proc = _run(sudo + ["apt-get", "install", "-y", "-q", *PACKAGES], env=env)
    if proc.returncode != 0:
        raise ClusterError(f"apt-get install {' '.join(PACKAGES)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def _munge_works() -> bool:
    encoded = _run(["munge", "-n"], timeout=30)
    return encoded.returncode == 0 and _run(["unmunge"], input=encoded.stdout, timeout=30).returncode == 0


def start_munge() -> Optional[int]:
    """munged running (started as the munge user when it is not); its pid when this call started it."""
    if _munge_works():
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _run(["mungekey", "--create"]) if shutil.which("mungekey") else _run(["create-munge-key", "-f"])
    for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        os.makedirs(folder, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    proc = _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], timeout=30)
    for _ in range(50):
        if _munge_works():
            pid_file = Path("/run/munge/munged.pid")
            return int(pid_file.read_text()) if pid_file.exists() else None
        time.sleep(0.2)
    raise ClusterError(f"munged did not start: {proc.stderr.strip()}")


def _free_ports(n: int) -> List[int]:
    """n distinct free ports below the ephemeral range (see trainer.parallel.dims.free_port)."""
    ports: List[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def slurm_conf(root: Path, ports: List[int], cpus: int) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName=n{i + 1} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[i + 1]} CPUs={cpus} "
                      f"RealMemory=4000 State=UNKNOWN" for i in range(2))
    return f"""ClusterName=tessera-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120: most of the requeue test's time);
# 20 s still covers a step launch on a loaded machine (the credential is checked when slurmd starts the step).
AuthInfo=cred_expire=20
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
MinJobAge=600
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 4):
        self.root = Path(root)
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.munged_pid: Optional[int] = None

    def env(self, **extra) -> dict:
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    def start(self) -> "SlurmCluster":
        install()
        self.munged_pid = start_munge()
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(slurm_conf(self.root, _free_ports(3), self.cpus))
        env = self.env()
        for cmd in (["slurmctld", "-f", str(self.conf), "-c"], ["slurmd", "-f", str(self.conf), "-N", "n1"],
                    ["slurmd", "-f", str(self.conf), "-N", "n2"]):
            proc = _run(cmd, env=env, timeout=60)
            if proc.returncode != 0:
                self.stop()
                raise ClusterError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}\n{self.logs()}")
        self._wait_idle(env)
        return self

    def _wait_idle(self, env: dict, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            out = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, timeout=30).stdout
            if sorted(line.split()[1] for line in out.splitlines() if line.strip()) == ["idle", "idle"]:
                return
            time.sleep(0.5)
        self.stop()
        raise ClusterError(f"the two nodes did not come up idle: {out!r}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        env = self.env()
        if shutil.which("scancel"):
            _run(["scancel", "--full", "--partition=debug"], env=env, timeout=60)
        for pid_file in sorted(self.root.glob("slurm*.pid")):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except OSError:
                pass

    def wait(self, job_id: str, timeout: float = 300) -> str:
        """Wait until the job left the queue; its last state as scontrol reports it (COMPLETED, FAILED, ...)."""
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            state = self.job_field(job_id, "JobState")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"):
                return state
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {state} after {timeout}s\n{self.logs()}")

    def job_field(self, job_id: str, key: str) -> str:
        out = _run(["scontrol", "show", "job", str(job_id)], env=self.env(), timeout=30).stdout
        for token in out.split():
            k, _, v = token.partition("=")
            if k == key:
                return v
        return ""

    def sbatch(self, args: List[str], env_extra: Optional[dict] = None, cwd: Optional[Path] = None) -> str:
        proc = _run(["sbatch", "--parsable", *args], env=self.env(**(env_extra or {})), cwd=cwd, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"sbatch {args} failed: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]
