"""Config checks for strategy=fsdp / hsdp, train.compile and activation checkpointing: each problem is one
message naming the key(s) to change, all of them reported together by trainer.run.build.check before any process
group starts."""
from __future__ import annotations

import pytest

from trainer.config import schema as C
from trainer.run.build import check
from tessera.errors import ConfigError
from trainer.config import compat
from trainer.strategies.torch_native import TorchNativeStrategy


def _problems(cfg, world_size):
    with pytest.raises(ConfigError) as info:
        check(cfg, world_size)
    err = info.value
    assert len(err.problems) == len(set(err.problems))
    assert f"{len(err.problems)} configuration problem(s)" in str(err)
    for p in err.problems:
        assert p in str(err)
    return err.problems


def _only_one(problems, *needles):
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, (needles, problems)
    return hits[0]


@pytest.mark.parametrize("overrides,world", [
    (["strategy=fsdp"], 2),
    (["strategy=fsdp"], 1),
    (["strategy=hsdp", "train.global_batch_size=32"], 4),  # 2 replicas x shards of 2
    (["strategy=hsdp", "strategy.dp_shard=2", "strategy.dp_replicate=1"], 2),
    (["strategy=fsdp", "precision=bf16", "strategy.param_dtype=bf16", "strategy.reduce_dtype=fp32"], 2),
    (["strategy=fsdp", "precision=fp16", "strategy.param_dtype=fp16"], 2),
    (["strategy=fsdp", "strategy.cpu_offload=true", "strategy.reshard_after_forward=false"], 2),
    (["strategy=fsdp", "train.activation_checkpointing=full", "train.activation_checkpointing_every=2"], 2),
])
def test_valid_fsdp_configs_pass(compose, overrides, world):
    dims, cls, _, _ = check(compose(overrides), world)
    assert cls is TorchNativeStrategy
    assert dims.world_size == world


def test_hsdp_degrees_fill(compose):
    dims, _, _, _ = check(compose(["strategy=hsdp", "train.global_batch_size=32"]), 4)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size) == (2, 2, 4)
    dims, _, _, _ = check(compose(["strategy=fsdp", "train.global_batch_size=32"]), 4)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size) == (1, 4, 4)


@pytest.mark.parametrize("overrides,needles", [
    (["strategy=fsdp", "strategy.dp_replicate=2"], ["strategy=fsdp", "strategy.dp_replicate must be 1",
                                                    "strategy=hsdp"]),
    (["strategy=fsdp", "strategy.param_dtype=fp8"], ["strategy.param_dtype='fp8'", "fp32, bf16, fp16"]),
    (["strategy=hsdp", "strategy.reduce_dtype=fp16"], ["strategy.reduce_dtype='fp16'", "fp32, bf16"]),
    (["strategy=fsdp", "strategy.offload_optimizer=cpu"], ["strategy.offload_optimizer=cpu", "DeepSpeed",
                                                           "strategy.cpu_offload=true",
                                                           "strategy.offload_optimizer=none"]),
    (["strategy=fsdp", "strategy.offload_param=cpu"], ["strategy.offload_param=cpu", "strategy.cpu_offload=true",
                                                       "strategy.offload_param=none"]),
    (["strategy=fsdp", "strategy.deepspeed_config=ds.json"], ["strategy.deepspeed_config", "strategy=fsdp"]),
    (["strategy=fsdp", "strategy.cpu_offload=true", "precision=fp16"], ["strategy.cpu_offload=true",
                                                                        "precision=fp16", "precision=bf16"]),
    (["strategy=fsdp", "strategy.param_dtype=fp16"], ["strategy.param_dtype=fp16", "precision=fp16",
                                                      "precision=fp32"]),
    (["strategy=hsdp", "strategy.param_dtype=fp16", "precision=bf16"], ["strategy.param_dtype=fp16",
                                                                        "precision=bf16"]),
    (["strategy=fsdp", "strategy.tp=2"], ["strategy=fsdp does not use strategy.tp"]),
    (["strategy=hsdp", "strategy.dp_shard=1", "strategy.pp=2"], ["strategy=hsdp does not use strategy.pp"]),
])
def test_each_fsdp_problem_names_its_keys(compose, overrides, needles):
    world = 2
    problems = _problems(compose(overrides), world)
    _only_one(problems, *needles)
    assert len(problems) == 1, problems
    # the class alone says the same
    assert any(all(n in p for n in needles) for p in compat.strategy_problems(TorchNativeStrategy, compose(overrides), world))


def test_fsdp_problems_reported_together(compose):
    cfg = compose(["strategy=fsdp", "strategy.dp_replicate=2", "strategy.param_dtype=fp8",
                   "strategy.reduce_dtype=fp16", "strategy.offload_optimizer=cpu", "strategy.offload_param=nvme",
                   "strategy.deepspeed_config=ds.json", "strategy.cpu_offload=true", "precision=fp16",
                   "train.activation_checkpointing=bogus", "optim.lr=-1", "train.global_batch_size=32"])
    problems = _problems(cfg, 4)
    _only_one(problems, "strategy.dp_replicate must be 1")
    _only_one(problems, "strategy.param_dtype='fp8'")
    _only_one(problems, "strategy.reduce_dtype='fp16'")
    _only_one(problems, "strategy.offload_optimizer=cpu", "strategy.cpu_offload=true")
    _only_one(problems, "strategy.offload_param=nvme", "strategy.cpu_offload=true")
    _only_one(problems, "strategy.deepspeed_config")
    _only_one(problems, "strategy.cpu_offload=true with precision=fp16")
    _only_one(problems, "train.activation_checkpointing='bogus'")
    _only_one(problems, "optim.lr=-1")
    assert len(problems) == 9, problems


@pytest.mark.parametrize("overrides,world,needles", [
    # 4 ranks are not a whole number of shard groups of 3
    (["strategy=hsdp", "strategy.dp_shard=3"], 4, ["world size 4 is not divisible", "strategy.dp_shard=3"]),
    (["strategy=hsdp", "strategy.dp_shard=3"], 2, ["world size 2 is not divisible", "strategy.dp_shard=3"]),
    # both fixed: 2 x 3 = 6 ranks, not 4
    (["strategy=hsdp", "strategy.dp_replicate=2", "strategy.dp_shard=3"], 4,
     ["multiply to 6", "strategy.dp_replicate=2", "strategy.dp_shard=3", "world size is 4"]),
    (["strategy=fsdp", "strategy.dp_shard=4"], 2, ["multiply to 4", "strategy.dp_shard=4", "world size is 2"]),
    (["strategy=hsdp", "strategy.dp_shard=-1"], 4, ["only one degree may be -1", "strategy.dp_replicate",
                                                    "strategy.dp_shard"]),
    (["strategy=hsdp", "strategy.dp_shard=0"], 4, ["strategy.dp_shard=0 must be a positive degree"]),
])
def test_degrees_not_matching_the_world_size(compose, overrides, world, needles):
    problems = _problems(compose(overrides), world)
    _only_one(problems, *needles)


def test_fsdp_with_replicas_is_rejected_also_when_degrees_do_not_fit(compose):
    """fsdp dp_replicate=2: the fsdp rule; with 3 replicas on 4 ranks the degree mismatch too, together."""
    problems = _problems(compose(["strategy=fsdp", "strategy.dp_replicate=2", "train.global_batch_size=32"]), 4)
    assert len(problems) == 1
    _only_one(problems, "strategy.dp_replicate must be 1 (got 2)", "strategy=hsdp")
    problems = _problems(compose(["strategy=fsdp", "strategy.dp_replicate=3"]), 4)
    _only_one(problems, "strategy.dp_replicate must be 1 (got 3)")
    _only_one(problems, "world size 4 is not divisible", "strategy.dp_replicate=3")
    assert len(problems) == 2, problems


# ---------------------------------------------------------------------------------------------------------
# train.compile

@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_compile_with_deepspeed_is_rejected(compose, strategy):
    problems = _problems(compose([f"strategy={strategy}", "train.compile=true"]), 2)
    _only_one(problems, "train.compile=true", f"strategy={strategy}", "train.compile=false")


def _no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, c++ nor clang++
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)


def test_compile_problems_without_a_cpp_compiler(monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path)
    problems = compat.compile_problems("cpu")
    assert len(problems) == 1
    assert "train.compile=true" in problems[0] and "C++ compiler" in problems[0]
    assert "'g++'" in problems[0] and "train.compile=false" in problems[0]


def test_compile_problems_with_shutil_which_finding_nothing(monkeypatch):
    monkeypatch.setattr(compat.shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setenv("CXX", "my-cxx")
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    problems = compat.compile_problems("cpu")
    assert len(problems) == 1 and "'my-cxx'" in problems[0] and "CXX" in problems[0]


def test_compile_problems_checks_the_compiler_inductor_runs(monkeypatch, tmp_path):
    """Inductor runs $CXX (default g++) and nothing else: clang++ alone on PATH, or a CXX that is not there
    while g++ is, still fails at the first compiled step."""
    for name in ("g++", "clang++"):
        exe = tmp_path / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert compat.compile_problems("cpu") == []  # g++ on PATH
    monkeypatch.setenv("CXX", "clang++")
    assert compat.compile_problems("cpu") == []
    monkeypatch.setenv("CXX", str(tmp_path / "g++"))  # a full path
    assert compat.compile_problems("cpu") == []
    monkeypatch.setenv("CXX", "/no/such/c++")
    problems = compat.compile_problems("cpu")
    assert len(problems) == 1 and "'/no/such/c++'" in problems[0]
    monkeypatch.delenv("CXX")
    (tmp_path / "g++").unlink()  # clang++ alone: inductor would not use it
    problems = compat.compile_problems("cpu")
    assert len(problems) == 1 and "'g++'" in problems[0]


def test_check_reports_missing_compiler_with_other_problems(compose, monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path)
    problems = _problems(compose(["strategy=fsdp", "train.compile=true", "train.device=cpu",
                                  "strategy.param_dtype=fp8"]), 2)
    _only_one(problems, "train.compile=true", "C++ compiler")
    _only_one(problems, "strategy.param_dtype='fp8'")
    assert len(problems) == 2, problems
    # the same on DDP (compile is every strategy's but DeepSpeed's)
    problems = _problems(compose(["strategy=ddp", "train.compile=true", "train.device=cpu"]), 2)
    _only_one(problems, "train.compile=true", "C++ compiler")


def test_compile_problems_without_dynamo(monkeypatch):
    monkeypatch.setattr(compat.torch._dynamo, "is_dynamo_supported", lambda: False)
    problems = compat.compile_problems("cpu")
    assert len(problems) == 1 and "train.compile=false" in problems[0]


def test_compile_problems_on_cuda_without_triton(monkeypatch):
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    problems = compat.compile_problems("cuda")
    assert len(problems) == 1 and "Triton" in problems[0] and "train.compile=false" in problems[0]
    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    assert compat.compile_problems("cuda:0") == []


def test_compile_false_is_never_checked(compose, monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path)
    check(compose(["strategy=fsdp", "train.device=cpu"]), 2)
    check(compose(["strategy=zero2"]), 2)


# ---------------------------------------------------------------------------------------------------------
# activation checkpointing

def test_activation_checkpointing_bogus_is_rejected(compose):
    problems = _problems(compose(["train.activation_checkpointing=bogus"]), 1)
    hit = _only_one(problems, "train.activation_checkpointing='bogus'")
    assert "none, full" in hit
    assert len(problems) == 1


@pytest.mark.parametrize("every", [0, -1])
def test_activation_checkpointing_every_must_be_positive(compose, every):
    cfg = compose(["train.activation_checkpointing=full", f"train.activation_checkpointing_every={every}"])
    problems = C.validate(cfg, 1)
    _only_one(problems, f"train.activation_checkpointing_every={every}", "must be > 0")
