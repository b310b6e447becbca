"""launch.sh under SLURM (trainer/launch/slurm.py) from SLURM's environment, without a cluster: the srun line of
the batch script, each node's settings, and the allocations launch.sh refuses (the real cluster:
tests/integration/test_slurm.py). Also the default run folder of a SLURM job and the deepspeed launcher's hostfile
for several nodes."""
from __future__ import annotations

import pytest

from trainer.config.compose import run_name
from trainer.launch.deepspeed import with_node_hostfile
from trainer.launch.slurm import SlurmError, fields, main, node_settings, step_options

BATCH = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}


def test_the_batch_script_starts_one_task_per_node():
    assert step_options(BATCH) == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                   "--export=ALL"]
    assert step_options(dict(BATCH, SLURM_NTASKS="4"))[1:3] == ["--nodes=2", "--ntasks=2"]  # more tasks: fine


@pytest.mark.parametrize("env,message", [
    (dict(BATCH, SLURM_NTASKS="1"), "has 1 task(s) on 2 nodes"),
    (dict(BATCH, NNODES="3"), "NNODES=3 but the SLURM allocation has 2 node(s)"),
    ({"SLURM_JOB_ID": "42"}, "not inside a SLURM allocation"),
], ids=["fewer-tasks-than-nodes", "nnodes-differs", "no-allocation"])
def test_a_batch_script_launch_sh_cannot_run_in_is_refused(env, message):
    with pytest.raises(SlurmError, match=message.replace("(", r"\(").replace(")", r"\)")):
        step_options(env)


def test_a_one_node_step_uses_torchrun_standalone_rendezvous():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0"}
    assert node_settings(env) == {"NNODES": "1", "NODE_RANK": "0"}  # no port: a free one, chosen by torchrun


@pytest.mark.parametrize("tasks,nnodes,message", [
    ("4", "", "this SLURM step runs 4 task(s) on 2 node(s)"),
    ("2", "4", "NNODES=4 but the SLURM allocation has 2 node(s)"),
])
def test_a_step_launch_sh_cannot_run_in_is_refused(tasks, nnodes, message, capsys, monkeypatch):
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": tasks, "SLURM_NODEID": "1",
           "SLURM_STEP_NODELIST": "n[1-2]", "NNODES": nnodes}
    with pytest.raises(SlurmError) as err:
        node_settings(env)
    assert message in str(err.value)
    monkeypatch.setattr("os.environ", env)
    assert main(["node"]) == 2
    assert capsys.readouterr().err.strip() == f"launch.sh: error: {err.value}"


def test_scontrol_records_parse_into_fields():
    record = "NodeName=n1 Arch=x86_64 CoresPerSocket=1\n   NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05.8"
    assert fields(record)["NodeAddr"] == "127.0.0.1" and fields(record)["NodeName"] == "n1"


def test_a_slurm_job_names_its_default_run_folder_after_the_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not run_name().startswith("slurm-")  # the launch time
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert run_name() == "slurm-1234"  # the same on every node and after a requeue
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1200")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert run_name() == "slurm-1200_3"


def test_the_deepspeed_launcher_of_several_nodes_gets_a_hostfile(tmp_path):
    argv = ["--num_gpus", "2", "--master_addr", "10.0.0.1", "--master_port", "29500", "--num_nodes", "3",
            "--node_rank", "1", "--no_ssh", "trainer/main.py", "strategy=zero2"]
    out = with_node_hostfile(argv, str(tmp_path))
    assert out == ["--hostfile", str(tmp_path / "hostfile"), *argv]
    assert (tmp_path / "hostfile").read_text() == "node0 slots=2\nnode1 slots=2\nnode2 slots=2\n"
    one_node = ["--num_gpus", "2", "trainer/main.py"]
    assert with_node_hostfile(one_node, str(tmp_path)) == one_node
    own = ["--hostfile", "/etc/hosts-of-mine", "--num_nodes", "2", "--no_ssh", "trainer/main.py"]
    assert with_node_hostfile(own, str(tmp_path)) == own
