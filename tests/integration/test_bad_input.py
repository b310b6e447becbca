"""Bad input: one clear message, a non-zero exit, no traceback, no hang (also with several ranks)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from tests.archs import make_model_folder
from tests.integration.catalogue import Timer, check_case
from tests.integration.conftest import REPO, SMALL, free_port, launch, run_process_group

QUICK = SMALL + ["train.max_steps=2", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false"]


def _files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "a"\n')
    (tmp_path / "bad.parquet").write_text("not a parquet file")
    (tmp_path / "sft_noanswer.jsonl").write_text('{"instruction": "hi", "output": ""}\n')
    (tmp_path / "ds_stage.json").write_text(json.dumps({"zero_optimization": {"stage": "two"}}))
    (tmp_path / "ds_offload.json").write_text(json.dumps({"zero_optimization": {"offload_optimizer": "cpu"}}))
    _foreign_adapter(tmp_path / "adapter-hidden-32")
    return tmp_path


def _foreign_adapter(folder):
    """A PEFT LoRA adapter for a Llama of hidden size 32 (QUICK's model has 64)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    folder.mkdir()
    LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], base_model_name_or_path="some/llama-h32",
               task_type="CAUSAL_LM").save_pretrained(str(folder))
    save_file({f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": torch.zeros(shape)
               for i in range(2) for ab, shape in (("A", (4, 32)), ("B", (32, 4)))},
              str(folder / "adapter_model.safetensors"))


CASES = [
    # (name, overrides, launcher, nproc, exit code, expected text in the message)
    ("unknown-key", ["train.bogus=1"], "python", 1, 2, "bogus"),
    ("missing-model-folder", ["model=hf", "model.name_or_path={tmp}/no-such-model"], "torchrun-quiet", 2, 2,
     "no such folder"),
    ("empty-data-file", ["data=text", "data.path={tmp}/empty.txt"], "torchrun-quiet", 2, 2, "is empty"),
    ("missing-data-file", ["data=text", "data.path={tmp}/nothing.txt"], "python", 1, 2, "no such file"),
    ("unreadable-jsonl", ["data=text", "data.path={tmp}/broken.jsonl"], "python", 1, 2, "cannot read"),
    ("unreadable-parquet", ["data=text", "data.path={tmp}/bad.parquet"], "python", 1, 2, "cannot read"),
    ("jsonl-without-field", ["data=text", "data.path={tmp}/nofield.jsonl"], "python", 1, 2,
     "no 'text' field"),
    ("sft-without-answer", ["data=sft", "data.path={tmp}/sft_noanswer.jsonl"], "python", 1, 2,
     "non-empty 'output'"),
    ("single-on-two-ranks", ["strategy=single"], "torchrun-quiet", 2, 2, "strategy=single runs one process"),
    # a hydra.* override that does not parse: Hydra would exit 1 with its own report on every rank
    ("hydra-override-does-not-parse", ["hydra.job.name=a=b"], "torchrun-quiet", 2, 2,
     "'hydra.job.name=a=b' does not parse"),
    ("degree-not-used", ["strategy=ddp", "strategy.tp=2"], "torchrun-quiet", 2, 2, "does not use strategy.tp"),
    ("batch-not-divisible", ["train.global_batch_size=6", "train.micro_batch_size=2"], "torchrun-quiet", 2, 2,
     "train.global_batch_size=6 must be divisible"),
    # Zero-bubble schedules under FSDP would silently lose part of the weight gradients (measured: grad norm 40-60%
    # off one process): refused before training.
    ("zero-bubble-with-fsdp", ["strategy=pp_fsdp", "strategy.pp=2", "strategy.pp_schedule=zbv",
                               "train.global_batch_size=8", "train.micro_batch_size=1"], "torchrun-quiet", 4, 2,
     "strategy.pp_schedule=zbv splits the backward into input and weight passes"),
    # torchft replica groups: a lighthouse nobody listens on is an error at start-up, not a hang in the first quorum
    ("torchft-lighthouse-unreachable", ["strategy=ddp", "strategy.fault_tolerance=torchft",
                                        "strategy.lighthouse=http://127.0.0.1:1"], "torchrun-quiet", 2, 2,
     "the torchft lighthouse at http://127.0.0.1:1 (strategy.lighthouse) cannot be reached"),
    # LoRA against the layout
    ("cp-heads-not-divisible", ["strategy=fsdp", "strategy.cp=2", "model.num_heads=1", "model.num_kv_heads=1"],
     "torchrun-quiet", 2, 2, "the llama model has 1 attention heads, not divisible by strategy.tp x strategy.cp = 2"),
    ("cp-mixing-outside-attention", ["model=hf", "model.name_or_path={tmp}/lfm2", "strategy=fsdp", "strategy.cp=2"],
     "torchrun-quiet", 2, 2, "the lfm2 model mixes tokens outside attention (its conv layers)"),
    ("cp-ring-on-cpu", ["strategy=fsdp", "strategy.cp=2", "strategy.cp_impl=ring", "train.device=cpu"],
     "torchrun-quiet", 2, 2, "strategy.cp_impl=ring needs CUDA attention kernels"),
    ("ep-on-a-dense-model", ["strategy=fsdp", "strategy.ep=2"], "torchrun-quiet", 2, 2,
     "strategy.ep=2 needs a mixture-of-experts model whose experts are fused 3-D tensors; llama has none"),
    ("lora-with-tensor-parallelism", ["peft=lora", "strategy=tp"], "torchrun-quiet", 2, 2,
     "peft=lora is not available with tensor or pipeline parallelism"),
    # data.follow: the file or folder records are appended to must exist.
    ("follow-path-missing", ["data=text", "data.path={tmp}/stream.jsonl", "data.follow=true", "eval.every=0"],
     "torchrun-quiet", 2, 2, "does not exist; point it at the JSONL file or the folder"),
]


@pytest.mark.parametrize("name,overrides,launcher,nproc,code,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_with_one_clear_message(tmp_path, name, overrides, launcher, nproc, code, expected):
    files = _files(tmp_path)
    if any("{tmp}/lfm2" in o for o in overrides):
        make_model_folder("lfm2", files / "lfm2")  # short convolutions beside attention
    args = QUICK + [o.format(tmp=files) for o in overrides]
    if launcher == "python" and not any(o.startswith("strategy=") for o in overrides):
        args.append("strategy=single")
    with Timer() as t:
        proc = launch(launcher, args, tmp_path / "run", nproc=nproc, timeout=120)  # a hang fails by timeout
    check_case(name, proc, t.seconds, code, expected)
    out = proc.stdout + proc.stderr
    if nproc > 1:
        # Rank 0 prints the message; the same config, data or model problem is not repeated by every rank.
        assert out.count(expected) == 1, out[-3000:]


# Configuration problems found together before any process group starts: each launch holds several independent
# cases of one layout (their launches differed only in the overrides), and every case must be listed in the one
# message, which counts them. (name, overrides, expected text) per case.
PROBLEM_GROUPS = {
    "single": [
        ("optim-eps-negative", ["optim.eps=-1"], "optim.eps=-1.0 must be > 0"),
        ("eval-max-sequences-negative", ["eval.max_sequences=-5"], "eval.max_sequences=-5 must be >= 0"),
        ("keep-last-negative", ["checkpoint.keep_last=-1"], "checkpoint.keep_last=-1 must be >= 0"),
        ("weight-decay-negative", ["optim.weight_decay=-5"], "optim.weight_decay=-5.0 must be >= 0"),
        ("seq-len-over-max", ["data.seq_len=4096", "model.max_position_embeddings=512"],
         "data.seq_len=4096 exceeds model.max_position_embeddings=512"),
        ("lora-targets-match-nothing", ["peft=lora", "peft.target_modules=[qkv_fused]"],
         "peft.target_modules=['qkv_fused'] matches no module of llama"),
    ],
    # Attention kernels this machine can't train with; with LoRA too (its check builds the model, which transformers
    # refused with a traceback from its kernel hub), and a mixture whose weights sum to zero.
    "single-kernels": [
        ("flash-attention-on-cpu", ["model.attn_implementation=flash_attention_2", "train.device=cpu", "peft=lora"],
         "model.attn_implementation=flash_attention_2 needs a CUDA device"),
        ("mixture-weights-sum-to-zero", ["data=mixture", "data.sources=[{{name: a, path: a.txt, weight: 0}}, "
                                         "{{name: b, path: b.txt, weight: 0}}]"],
         "data.sources weights [0.0, 0.0] sum to zero; give at least one source a weight > 0"),
    ],
    # DeepSpeed JSON with wrong types (checked before DeepSpeed sees it, naming the JSON key) and what ZeRO can't do
    # on this machine or with this synchronisation.
    "zero2": [
        ("ds-json-stage-not-a-number", ["strategy.deepspeed_config={tmp}/ds_stage.json"],
         "zero_optimization.stage='two' must be one of 0, 1, 2, 3"),
        ("zero-fp16-on-cpu", ["precision=fp16", "train.device=cpu"],
         "precision=fp16 with strategy=zero2 needs a CUDA device"),
        ("diloco-on-zero2", ["sync=diloco"], "sync=diloco is not available with strategy=zero2; use strategy=ddp"),
        ("muon-on-zero-partitions", ["optim=muon"], "optim.name=muon: it orthogonalises each matrix's update "
                                                    "(Newton-Schulz), but strategy=zero2 hands the optimizer ZeRO's "
                                                    "flat 1-D partitions"),
    ],
    "zero3": [
        ("ds-json-offload-not-an-object", ["strategy.deepspeed_config={tmp}/ds_offload.json"],
         "zero_optimization.offload_optimizer='cpu' must be a JSON object"),
        ("zeropp-on-cpu", ["strategy.zero_quantized_gradients=true", "train.device=cpu"],
         "needs CUDA devices (DeepSpeed's quantisation kernels)"),
        ("adafactor-on-zero-partitions", ["optim=adafactor"], "optim.name=adafactor: it factors each matrix's "
                                                              "second moment into row and column means"),
    ],
    # A torchft group that does not say which it is would train on another group's share of the data.
    "ddp": [
        ("powersgd-warmup-too-short", ["strategy.comm_hook=powersgd", "strategy.powersgd_warmup_steps=1"],
         "strategy.powersgd_warmup_steps=1 must be >= 2"),
        ("torchft-group-not-named", ["strategy.fault_tolerance=torchft", "strategy.replica_groups=2",
                                     "strategy.lighthouse=http://127.0.0.1:1"],
         "strategy.replica_group=-1 must name this job's group, 0..1"),
    ],
    "ddp-local-sgd": [
        ("sync-hook-together", ["sync=local_sgd", "strategy.comm_hook=bf16"],
         "strategy.comm_hook=bf16 compresses the per-step gradient reduction, which sync=local_sgd does not run"),
        ("flex-attention-on-cpu", ["model.attn_implementation=flex_attention", "train.device=cpu"],
         "model.attn_implementation=flex_attention can't train on the CPU"),
    ],
    "fsdp": [
        ("comm-hook-on-fsdp", ["strategy.comm_hook=powersgd"],
         "strategy.comm_hook=powersgd is a DDP communication hook; strategy=fsdp cannot use it"),
        ("lora-adapter-of-another-base-model", ["peft=lora", "peft.adapter={tmp}/adapter-hidden-32"],
         "is an adapter for another base model (some/llama-h32)"),
        ("adamw-8bit-on-dtensors", ["optim=adamw_8bit"], "optim.name=adamw_8bit: bitsandbytes' 8-bit kernels have "
                                                         "no DTensor rules, and strategy=fsdp steps DTensors here"),
    ],
}


@pytest.mark.parametrize("group", PROBLEM_GROUPS)
def test_configuration_problems_exit_2_listed_together(tmp_path, group):
    files = _files(tmp_path)
    cases = PROBLEM_GROUPS[group]
    strategy = group.split("-")[0]
    args = QUICK + [f"strategy={strategy}"] + [o.format(tmp=files) for _, overrides, _ in cases for o in overrides]
    with Timer() as t:
        proc = launch("python", args, tmp_path / "run", timeout=120)  # a hang fails by timeout
    out = proc.stdout + proc.stderr
    assert f"error: {len(cases)} configuration problem(s):" in out, out[-3000:]
    for name, _, expected in cases:
        check_case(name, proc, t.seconds, 2, expected)
        assert out.count(expected) == 1, out[-3000:]


# Errors every rank meets from the same input (config, data, model, run directory): printed once, by rank 0, under
# each launcher (docs/errors-and-exit-codes.md); the other ranks wait for rank 0 to end the job (trainer/run/cli.py exit_with).
# Every kind of error and every launcher at least once (the whole product would add minutes, not coverage).
SAME_INPUT = [
    # (name, overrides, launcher, expected text)
    ("missing-data-path", ["strategy=ddp", "data=text", "data.path={tmp}/nothing.txt"], "launch.sh",
     "data.path='{tmp}/nothing.txt': no such file or folder"),
    ("unreadable-sft-record", ["strategy=ddp", "data=sft", "data.path={tmp}/sft_noanswer.jsonl"], "deepspeed",
     "record 0 needs text in 'instruction' and a non-empty 'output'"),
    ("missing-model-folder", ["strategy=ddp", "model=hf", "model.name_or_path={tmp}/no-such-model"], "torchrun",
     "'{tmp}/no-such-model': no such folder"),
    # found before Hydra starts (trainer/run/cli.py run_dir_preflight): the run directory's parent is a file
    ("unwritable-run-dir", ["strategy=ddp"], "launch.sh",
     "hydra.run.dir={tmp}/a-file/run: {tmp}/a-file is not a folder"),
]


def _launch_sh(args, run_dir, timeout: float):
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TESSERA_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    return run_process_group([str(REPO / "launch.sh")] + args + [f"hydra.run.dir={run_dir}"], env=env,
                             timeout=timeout)


@pytest.mark.parametrize("name,overrides,launcher,expected", SAME_INPUT, ids=[c[0] for c in SAME_INPUT])
def test_same_input_error_printed_once_by_rank_0(tmp_path, name, overrides, launcher, expected):
    files = _files(tmp_path)
    (files / "a-file").write_text("")
    run_dir = files / "a-file" / "run" if name == "unwritable-run-dir" else files / "run"
    args, expected = QUICK + [o.format(tmp=files) for o in overrides], expected.format(tmp=files)
    with Timer() as t:
        if launcher == "launch.sh":
            proc = _launch_sh(args, run_dir, timeout=180)
        else:
            proc = launch(launcher, args, run_dir, nproc=2, timeout=180)  # a hang fails by timeout
    out = proc.stdout + proc.stderr
    # torchrun itself ends a failed job with its ChildFailedError report (a traceback of torchrun's, exit 1) naming
    # the rank that failed first and its code; launch.sh and deepspeed pass the rank's code on.
    code = 1 if launcher == "torchrun" else 2
    check_case(f"{name} ({launcher}, 2 ranks)", proc, t.seconds, code, expected,
               allow_traceback=launcher == "torchrun")
    errors = [line for line in out.splitlines() if re.match(r"(\[rank \d+\] )?error: ", line)]
    assert len(errors) == 1 and out.count(expected) == 1, out[-3000:]
    assert errors[0].startswith("[rank 0] error: ") and expected in out[out.index(errors[0]):], out[-3000:]
    if launcher == "torchrun":
        assert out.count("Traceback") == 1 and "ChildFailedError" in out, out[-3000:]
        assert re.search(r"Root Cause \(first observed failure\):\n\[0\]:(\n.*){3}\n\s*exitcode\s*: 2 ", out), \
            out[-3000:]


def test_same_input_error_without_rank_0(tmp_path):
    """A rank that meets an error every rank should meet, while rank 0 does not end the job (here rank 0 never
    started: another node's files, a launcher that does not stop the others): it prints the message itself after
    TESSERA_RANK0_WAIT_S rather than exit silently."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="1", LOCAL_RANK="1",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TESSERA_RANK0_WAIT_S="2")
    args = QUICK + ["strategy=ddp", "model=hf", f"model.name_or_path={tmp_path}/no-such-model"]
    with Timer() as t:
        proc = run_process_group([sys.executable, str(REPO / "trainer" / "main.py")] + args +
                                 [f"hydra.run.dir={tmp_path / 'run'}"], env=env, timeout=120)
    check_case("same-input-error-rank-0-absent", proc, t.seconds, 2, "no-such-model': no such folder")
    assert "[rank 1] error: 1 configuration problem(s)" in proc.stderr, proc.stderr[-3000:]


def test_all_config_problems_reported_together(tmp_path):
    proc = launch("python", QUICK + ["strategy=single", "train.global_batch_size=10", "train.micro_batch_size=4",
                                     "optim.name=adam", "data.seq_len=4096", "scheduler.name=step"],
                  tmp_path / "run", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    for key in ("train.global_batch_size=10", "optim.name='adam'", "data.seq_len=4096", "scheduler.name='step'"):
        assert key in out, out
    assert "4 configuration problem(s)" in out


def test_fsdp_config_problems_through_torchrun(tmp_path):
    """strategy=hsdp with shard groups of 3 on 2 ranks, plus a DeepSpeed offload key: exit 2 before any
    process group starts, both problems in one message printed once (rank 0), no traceback, no hang."""
    proc = launch("torchrun-quiet", QUICK + ["strategy=hsdp", "strategy.dp_shard=3", "strategy.offload_optimizer=cpu"],
                  tmp_path / "run", nproc=2, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.count("2 configuration problem(s)") == 1, out[-3000:]
    assert out.count("world size 2 is not divisible") == 1 and "strategy.dp_shard=3" in out, out[-3000:]
    assert out.count("strategy.offload_optimizer=cpu is a DeepSpeed option") == 1, out[-3000:]
    assert "set strategy.cpu_offload=true and strategy.offload_optimizer=none" in out, out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------
# Folders that can't be written, a damaged tokenization cache, MASTER_PORT in use, a peer that died, a
# collective that timed out: each one line, its exit code, no traceback, no hang.

@contextmanager
def _read_only_folder(path):
    """A read-only folder: a read-only tmpfs where we may mount (root), else a chmod 0555 folder (non-root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without permission to mount a read-only tmpfs: no read-only folder to test")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def test_an_error_inside_a_pipeline_stage_keeps_its_message_and_exit_code(tmp_path):
    """OPT's mask ignores packed position ids: under pp the first stage's check raises inside torch's schedule, which
    wraps whatever a stage raises in a RuntimeError; the run still ends with the check's one message and exit 2, as
    on one process."""
    from tests.archs import make_model_folder

    opt = make_model_folder("opt", tmp_path / "opt", seed=0)
    args = ["model=hf", f"model.name_or_path={opt}", "strategy=pp", "data.packing=documents", "data.seq_len=32",
            "data.embedded_documents=60", "train.max_steps=2", "train.global_batch_size=8",
            "train.micro_batch_size=2", "eval.every=0", "eval.at_end=false", "export.hf_at_end=false",
            "logging.progress=false"]
    with Timer() as t:
        proc = launch("torchrun-quiet", args, tmp_path / "run", nproc=2, timeout=120)
    check_case("packed-documents-a-pipeline-stage-cannot-keep-apart", proc, t.seconds, 2,
               "the opt model does not read restarting position ids as packed documents")


def test_read_only_run_dir(tmp_path):
    with _read_only_folder(tmp_path / "ro") as ro, Timer() as t:
        proc = launch("python", QUICK + ["strategy=single"], ro / "run", timeout=120)
    check_case("read-only-run-dir", proc, t.seconds, 2, f"hydra.run.dir={ro / 'run'}")
    assert "read-only file system" in proc.stderr or "not writable" in proc.stderr, proc.stderr


def test_read_only_cache_dir(tmp_path):
    with _read_only_folder(tmp_path / "ro") as ro, Timer() as t:
        proc = launch("python", QUICK + ["strategy=single", f"data.cache_dir={ro}"], tmp_path / "run", timeout=120)
    check_case("read-only-cache-dir", proc, t.seconds, 2, f"data.cache_dir={ro}")
    with _read_only_folder(tmp_path / "ro2") as ro, Timer() as t:  # the default cache folder, from TESSERA_CACHE
        proc = launch("python", QUICK + ["strategy=single"], tmp_path / "run2", timeout=120,
                      env={"TESSERA_CACHE": str(ro)})
    check_case("read-only-TESSERA_CACHE", proc, t.seconds, 2, "TESSERA_CACHE")


def test_read_only_export_folder(tmp_path):
    with _read_only_folder(tmp_path / "ro") as ro, Timer() as t:
        proc = run_process_group([sys.executable, "-m", "trainer.export", str(tmp_path / "no-checkpoint"), str(ro / "out")],
                         timeout=120)
    check_case("read-only-export-folder", proc, t.seconds, 2, f"the export folder {ro / 'out'}")


def test_truncated_cache_entry_is_rebuilt(tmp_path):
    cache = tmp_path / "cache"
    args = QUICK + ["strategy=single", "train.max_steps=1", "checkpoint.at_end=false", f"data.cache_dir={cache}"]
    first = launch("python", args, tmp_path / "run1", timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    tokens = next(cache.glob("*/tokens.bin"))
    with open(tokens, "r+b") as fh:  # an entry cut short (disk full, a killed copy, ...)
        fh.truncate(tokens.stat().st_size // 2)
    with Timer() as t:
        proc = launch("python", args, tmp_path / "run2", timeout=120)
    check_case("truncated-cache-entry", proc, t.seconds, 0, f"tokenization cache entry {tokens.parent} is damaged")
    assert "tokens.bin has" in proc.stdout and "rebuilding it" in proc.stdout, proc.stdout[-2000:]
    meta = json.loads((tokens.parent / "meta.json").read_text())
    assert meta["files"]["tokens.bin"] == tokens.stat().st_size


@contextmanager
def _busy_port():
    with socket.socket() as s:  # another program listening on the port (on every address, as a store would)
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def test_master_port_in_use(tmp_path):
    with _busy_port() as port:
        # A plain one-process run needs no rendezvous: an exported MASTER_ADDR/MASTER_PORT is not used.
        with Timer() as t:
            proc = launch("python", QUICK + ["strategy=ddp", "checkpoint.at_end=false"], tmp_path / "run1",
                          timeout=120, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        check_case("MASTER_PORT-in-use-one-process", proc, t.seconds, 0, "step 2")
        # Rank 0 of a 2-rank job started by a launcher that only sets the environment (deepspeed, srun, ...).
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with Timer() as t:
            proc = run_process_group([sys.executable, str(REPO / "trainer" / "main.py")] + QUICK +
                             ["strategy=ddp", f"hydra.run.dir={tmp_path / 'run2'}"], env=env, timeout=120)
        check_case("MASTER_PORT-in-use-rank0", proc, t.seconds, 2, f"MASTER_PORT={port} is already in use")


def test_master_port_in_use_torchrun(tmp_path):
    with _busy_port() as port, Timer() as t:
        proc = run_process_group([sys.executable, "-m", "trainer.torchrun", "--nproc_per_node=2", f"--master_port={port}",
                          str(REPO / "trainer" / "main.py")] + QUICK + [f"hydra.run.dir={tmp_path / 'run'}"],
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    check_case("MASTER_PORT-in-use-torchrun", proc, t.seconds, 2, f"MASTER_PORT={port} is already in use")


LONG = SMALL + ["strategy=ddp", "train.max_steps=100000", "train.log_every=1", "eval.every=0", "eval.at_end=false",
                "export.hf_at_end=false", "checkpoint.at_end=false", "train.collective_timeout_s=10"]


def _rank_pid(launcher_pid: int, rank: int, deadline: float) -> int:
    """The pid of `rank` among the launcher's children (its environment says RANK=<rank>)."""
    while time.time() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    environ = fh.read().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
                return int(entry)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} not found")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


class _Reader:
    """Reads a process's combined output in a thread (a full pipe would block the process)."""

    def __init__(self, proc):
        import threading

        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append(line)

    def wait_for(self, prefix: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not any(line.startswith(prefix) for line in list(self.lines)):
            if time.time() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"no {prefix!r} line within {timeout}s\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.2)

    def finish(self, timeout: float):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"no exit within {timeout}s (a hang?)\n{''.join(self.lines)[-3000:]}")
        self.thread.join(10)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "".join(self.lines), "")


def test_peer_rank_killed(tmp_path):
    """kill -9 rank 1 mid-training. Both ranks are started the way deepspeed's launcher or srun start them (the
    environment only, no torchrun agent that would SIGTERM the survivor first): rank 0 ends within
    train.collective_timeout_s with exit code 4 and one line saying rank 1 is gone."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(REPO / "trainer" / "main.py")] + LONG +
                                      [f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        reader = _Reader(procs[0])
        reader.wait_for("step 3 ", 180)
        procs[1].kill()
        with Timer() as t:
            proc = reader.finish(60)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        procs[1].wait()
    check_case("peer-rank-killed", proc, t.seconds, 4, "[rank 0] error: rank 1 is gone")
    assert t.seconds < 10 + 15, t.seconds  # within train.collective_timeout_s (plus teardown)


def test_collective_timeout(tmp_path):
    """SIGSTOP rank 1 of a 2-rank torchrun job: rank 0's next collective times out after
    train.collective_timeout_s=10; it exits 4 naming the key, the launcher passes the code on."""
    cmd = [sys.executable, "-m", "trainer.torchrun", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "trainer" / "main.py")] + LONG + [f"hydra.run.dir={tmp_path / 'run'}"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    stopped = None
    try:
        reader = _Reader(launcher)
        reader.wait_for("step 3 ", 180)
        first = _rank_pid(launcher.pid, 0, time.time() + 10)
        stopped = _rank_pid(launcher.pid, 1, time.time() + 10)
        os.kill(stopped, signal.SIGSTOP)
        with Timer() as t:
            deadline = time.time() + 60
            while os.path.exists(f"/proc/{first}") and _state(first) != "Z" and time.time() < deadline:
                time.sleep(0.2)  # rank 0 waits train.collective_timeout_s, then exits
            try:
                os.kill(stopped, signal.SIGKILL)  # a stopped rank would ignore the launcher's SIGTERM
            except ProcessLookupError:
                pass  # the launcher killed and reaped it already (trainer/launch/torchrun.py: stopped ranks)
            proc = reader.finish(60)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    check_case("collective-timeout", proc, t.seconds, 4, "train.collective_timeout_s=10")
    assert "[rank 0] error: a collective timed out" in proc.stdout, proc.stdout[-3000:]
