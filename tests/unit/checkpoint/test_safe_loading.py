"""No code from a file runs: crafted payloads for every unpickling path (trainer/checkpoint/safe_load.py), each refused with
a CheckpointError / ModelError naming the file and the global, and no marker file created."""
from __future__ import annotations

import pickle
import pickletools
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.payloads import SystemCall, stack_global_call
from tessera.errors import CheckpointError
from trainer.checkpoint.safe_load import SafeFileSystemReader
from tessera.errors import ModelError, TesseraError
from tessera.pickles import load_tensors
from trainer.checkpoint.safe_load import DCP_METADATA_GLOBALS, check_deepspeed_files, deepspeed_loads_weights_only


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "code from a file ran"


def _globals_of(data: bytes) -> set:
    """(module, name) of every GLOBAL / STACK_GLOBAL in a pickle, from its opcodes (nothing is executed)."""
    out, strings, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET"):
            strings.append(memo.get(arg))
        elif op.name == "GLOBAL":
            out.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            out.add((strings[-2], strings[-1]))
        else:
            strings.append(None)
    return out


# ---- DCP metadata ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("module,name", [
    ("torch.distributed.checkpoint.filesystem", "os.system"),  # the dotted-name trick (protocol 4)
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
    ("torch.distributed.checkpoint.state_dict_loader", "load"),  # a DCP function, not a record type
    ("torch", "load"),
    ("builtins", "exec"),
    ("posix", "system"),
])
def test_metadata_with_a_foreign_global_is_refused(tmp_path, marker, module, name):
    (tmp_path / ".metadata").write_bytes(stack_global_call(module, name, f"touch {marker}"))
    with pytest.raises(CheckpointError, match=r"\.metadata refers to .*refusing to load it") as info:
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert f"{module}.{name}" in str(info.value)


def test_the_dotted_name_trick_would_run_code_without_the_allow_list(tmp_path):
    """The payload is real: plain pickle runs it (this is what a prefix match on the module admitted)."""
    ran = tmp_path / "ran"
    pickle.loads(stack_global_call("torch.distributed.checkpoint.filesystem", "os.system", f"touch {ran}"))
    assert ran.exists()


def test_allow_list_holds_exactly_what_dcp_writes(tmp_path):
    """Every global of a freshly written .metadata (fp32, bf16, int64, several chunks) is allowed, and the list has
    nothing but DCP's record types, torch.Size, layouts, dtypes and the checkpoint path."""
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                       "n": torch.tensor(7)}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    written = _globals_of((tmp_path / ".metadata").read_bytes())
    assert written <= DCP_METADATA_GLOBALS, written - DCP_METADATA_GLOBALS
    dtypes = {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert DCP_METADATA_GLOBALS - dtypes == {
        ("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
            "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
        ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}
    assert all("." not in name for _, name in DCP_METADATA_GLOBALS)
    meta = SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert set(meta.state_dict_metadata) == {"model.w", "model.b", "model.n"}


# ---- torch.save files: RNG state, pretrained pytorch_model.bin ------------------------------------------

def test_tensor_file_that_would_run_code_is_refused(tmp_path, marker):
    path = tmp_path / "rank_0.pt"
    torch.save({"torch": torch.ones(2), "python": SystemCall(f"touch {marker}")}, path)
    with pytest.raises(CheckpointError, match=r"RNG state file .*rank_0\.pt: it refers to posix\.system") as info:
        load_tensors(str(path), "RNG state file")
    assert "weights_only" not in str(info.value)  # never the advice to turn the protection off
    state = {"python": (3, tuple(range(5)), None), "torch": torch.get_rng_state()}
    torch.save(state, path)
    assert load_tensors(str(path))["python"] == state["python"]


def test_pretrained_bin_that_would_run_code_is_refused(tmp_path, marker):
    from types import SimpleNamespace

    from models.weights import PretrainedWeights

    torch.save({"lm_head.weight": torch.ones(2, 2), "x": SystemCall(f"touch {marker}")}, tmp_path / "pytorch_model.bin")
    m = SimpleNamespace(name_or_path=str(tmp_path), revision=None, trust_remote_code=False)
    with pytest.raises(ModelError, match=r"pytorch_model\.bin: it refers to posix\.system") as info:
        PretrainedWeights(m)
    assert "weights_only" not in str(info.value)


# ---- DeepSpeed files -------------------------------------------------------------------------------------

def _deepspeed_like_state() -> dict:
    """What ZeRO optimizer files hold besides tensors: the stage enum, the loss scaler (fp16's dynamic one, made
    by DeepSpeed's own factory from an fp16 config: ZeRO cannot run fp16 on CPU), ZeRO-1/2's fragment addresses."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    fp16 = DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 0}}).float16_config
    dynamic = CreateLossScaler(torch.half, 0, True, fp16.dynamic_loss_scale_args())
    return {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
                                     "dynamic": dynamic,
                                     "param_slice_mappings": [OrderedDict(w=fragment_address(numel=4, start=0))],
                                     "single_partition_of_fp32_groups": [torch.zeros(4)]},
            "param_shapes": [OrderedDict(w=torch.Size([2, 2]))], "ds_version": "0"}


def test_deepspeed_files_with_their_own_classes_pass(tmp_path):
    (tmp_path / "zero").mkdir()
    torch.save(_deepspeed_like_state(), tmp_path / "zero" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    check_deepspeed_files(str(tmp_path))
    assert type(_deepspeed_like_state()["optimizer_state_dict"]["dynamic"]).__name__ == "DynamicLossScaler"


@pytest.mark.parametrize("payload", ["system", "exec", "foreign-class"])
def test_deepspeed_file_that_would_run_code_is_refused(tmp_path, marker, payload):
    (tmp_path / "zero").mkdir()
    good = tmp_path / "zero" / "mp_rank_00_model_states.pt"
    torch.save(_deepspeed_like_state(), good)
    bad = tmp_path / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if payload == "system":
        torch.save({"optimizer_state_dict": SystemCall(f"touch {marker}")}, bad)
        expected = "posix.system"
    elif payload == "exec":
        import builtins

        class _Exec:
            def __reduce__(self):
                return (builtins.exec, (f"open({str(marker)!r}, 'w').close()",))

        torch.save([_Exec()], bad)
        expected = "exec"  # torch names builtins by their bare name
    else:
        from argparse import Namespace  # a class DeepSpeed's files never hold

        torch.save({"args": Namespace(a=1)}, bad)
        expected = "argparse.Namespace"
    with pytest.raises(CheckpointError, match=r"DeepSpeed checkpoint file .*zero_pp_rank_1_mp_rank_00_optim_states"
                                              r"\.pt: it refers to " + expected.replace(".", r"\.")):
        check_deepspeed_files(str(tmp_path))


def test_damaged_deepspeed_file_is_one_clear_error(tmp_path):
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt is damaged"):
        check_deepspeed_files(str(tmp_path))


def test_deepspeeds_own_reads_are_weights_only_while_it_loads(tmp_path, marker):
    path = tmp_path / "x.pt"
    torch.save({"s": SystemCall(f"touch {marker}")}, path)
    original = torch.load
    with deepspeed_loads_weights_only():
        with pytest.raises(pickle.UnpicklingError, match="posix.system"):
            torch.load(path, map_location="cpu", weights_only=False)  # what DeepSpeed's code calls
        good = tmp_path / "good.pt"
        torch.save(_deepspeed_like_state(), good)
        assert torch.load(good, weights_only=False)["ds_version"] == "0"
    assert torch.load is original


def test_refusals_are_bad_input():
    assert issubclass(CheckpointError, TesseraError) and CheckpointError("x").exit_code == 2


def test_deepspeed_allow_list_is_exact_names():
    from trainer.checkpoint.safe_load import DEEPSPEED_GLOBALS, deepspeed_globals

    for (module, name), obj in zip(DEEPSPEED_GLOBALS, deepspeed_globals()):
        assert "." not in name and (obj.__module__, obj.__qualname__) == (module, name)
