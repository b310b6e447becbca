"""Writing a Hugging Face folder (safetensors + config + tokenizer) atomically: from a whole model, or streamed
tensor by tensor from a sharded one. Non-finite weights are refused (a diverged model is never exported)."""
from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import sys

import torch

from models.init import meta_model
from models.loading import causal_lm_class
from models.lora import ADAPTER_WEIGHTS
from tessera.errors import DivergenceError
from trainer.run.precision import DTYPES


def write_hf_folder_streaming(config, tokenizer, out_dir: str, named_tensors, writer: bool,
                              max_shard_bytes: int = 2 << 30, dtype=None, generation_config=None) -> None:
    """An HF model folder written one tensor at a time: `named_tensors` yields (name, tensor) on every rank
    (its iteration may be collective, e.g. gathering one sharded parameter at a time); the writer rank keeps at
    most one shard (`max_shard_bytes`) in memory, so no rank ever holds the whole model. Atomic like
    write_hf_folder. `dtype` (fp32 / bf16 / fp16 or a torch dtype; None: as yielded): the writer casts every
    floating-point tensor to it. config.json's `dtype` states the dtype written. `generation_config` (the model's):
    written as generation_config.json, as save_pretrained writes it."""
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir + ".tmp"
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if not writer:
        for _ in named_tensors:  # every rank iterates: the iteration may be collective
            pass
        return
    shards = _Shards(tmp, max_shard_bytes, _export_torch_dtype(dtype))
    for name, tensor in saved_layout(config, named_tensors):
        shards.add(name, tensor)
    if shards.non_finite:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_non_finite(shards.non_finite)
    shards.finish()
    exported_config(config).save_pretrained(tmp)
    copy_remote_code(config, tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    if shards.written is not None:
        _stamp_config_dtype(tmp, shards.written)
    tokenizer.save_pretrained(tmp)
    replace_folder(tmp, out_dir)


def copy_remote_code(config, folder: str) -> None:
    """A remote-code model's own modelling files (the module of its class and what it imports relatively) beside
    config.json, as save_pretrained copies them (config.save_pretrained copies the config's only), so the folder
    loads with trust_remote_code=True as its source did."""
    cls = causal_lm_class(config)  # a remote class once built in this process, else None
    remote = cls is None or not cls.__module__.startswith("transformers.")
    if not remote or "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {}):
        return
    from transformers.dynamic_module_utils import custom_object_save  # start-up time, as saved_layout's import

    custom_object_save(meta_model(config), folder)


def saved_layout(config, named_tensors):
    """(name, tensor) of the model's full tensors as save_pretrained writes them: a tied LM head once, under the
    embedding's name (from_pretrained ties it again), and transformers' load-time conversions reverted (its
    save_original_format: GPT-NeoX's lm_head back to embed_out, fused experts back to per-expert tensors, ...), one
    decoder block at a time, so no more than a block is held. Remote code (no class known here): as they come."""
    from transformers.core_model_loading import revert_weight_conversion

    if causal_lm_class(config) is None:
        yield from named_tensors
        return
    model = meta_model(config)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    group, block = {}, None
    for name, tensor in named_tensors:
        if name in aliases:
            continue
        key = _block_of(name)
        if group and key != block:
            yield from revert_weight_conversion(model, group).items()
            group = {}
        block = key
        group[name] = tensor
    if group:
        yield from revert_weight_conversion(model, group).items()


def _block_of(name: str) -> str:
    """The decoder block a tensor belongs to (its name up to the first numeric part: model.layers.3, transformer.h.0),
    or the name itself: transformers' conversions act within a block."""
    match = re.match(r"(.*?\.\d+)\.", name)
    return match.group(1) if match else name


def exported_config(config):
    """The config as save_pretrained writes it: `architectures` names the class the weights are for (serving stacks
    such as vLLM pick the model by it; a preset's config is made without it, and a source's may name its base
    model): the causal LM class transformers builds for it. Remote code (no such class known): as it is."""
    cls = causal_lm_class(config)
    if cls is None or list(getattr(config, "architectures", None) or []) == [cls.__name__]:
        return config
    config = copy.deepcopy(config)
    config.architectures = [cls.__name__]
    return config


class _Shards:
    """The writer's safetensors shards in `tmp`, each up to `max_shard_bytes` (one held in memory at a time).
    Floating-point tensors are cast to `cast_to` (None: kept); the first non-finite tensor stops the writing."""

    def __init__(self, tmp: str, max_shard_bytes: int, cast_to):
        self.tmp, self.max_shard_bytes, self.cast_to = tmp, max_shard_bytes, cast_to
        self.shard, self.shard_bytes, self.files, self.weight_map, self.total = {}, 0, [], {}, 0
        self.written = None  # the dtype floating-point tensors are written in
        self.non_finite = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.non_finite:
            return
        floating = tensor.is_floating_point()
        if floating and not bool(torch.isfinite(tensor).all()):
            self.non_finite.append(name)
            return
        target = self.cast_to if floating and self.cast_to is not None else tensor.dtype
        if floating and self.written is None:
            self.written = target
        nbytes = tensor.numel() * target.itemsize
        if self.shard and self.shard_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.shard[name] = tensor.detach().to("cpu", dtype=target, copy=True).contiguous()
        self.shard_bytes += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            name = f"shard-{len(self.files):05d}.safetensors"
            save_file(self.shard, os.path.join(self.tmp, name), metadata={"format": "pt"})
            self.files.append(name)
            self.weight_map.update({k: name for k in self.shard})
        self.shard, self.shard_bytes = {}, 0

    def finish(self) -> None:
        """The last shard written, the files given HF's names (one: model.safetensors; more: numbered, with
        model.safetensors.index.json)."""
        import json

        self.flush()
        tmp, files = self.tmp, self.files
        if len(files) == 1:
            os.rename(os.path.join(tmp, files[0]), os.path.join(tmp, "model.safetensors"))
            return
        final = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
        for f, g in final.items():
            os.rename(os.path.join(tmp, f), os.path.join(tmp, g))
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": self.total},
                       "weight_map": {k: final[v] for k, v in self.weight_map.items()}}, fh, indent=1)


def raise_non_finite(names) -> None:
    raise DivergenceError(f"the model holds non-finite weights ({len(names)} tensor(s), e.g. {names[0]}): not "
                          f"exported; export an earlier checkpoint")


@contextlib.contextmanager
def _unwrap_without_importing_deepspeed():
    """save_pretrained unwraps the model with accelerate's extract_model_from_parallel, which imports DeepSpeed
    (about 0.35 s of CPU per export here) to ask whether the model is its engine. In a process that has not imported
    DeepSpeed it cannot be, so accelerate is told DeepSpeed is absent for that call; ZeRO runs (DeepSpeed
    imported) are unchanged."""
    other = sys.modules.get("accelerate.utils.other")
    if "deepspeed" in sys.modules or other is None or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    available = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = available


def write_hf_folder(model, tokenizer, out_dir: str, state_dict=None, dtype=None) -> None:
    """`model` (or `state_dict`) through save_pretrained. `dtype` (fp32 / bf16 / fp16 or a torch dtype; None: as
    they are): floating-point tensors are written in it (tied weights stay one tensor), and config.json's `dtype`
    says so."""
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    named = model.state_dict() if state_dict is None else state_dict
    non_finite = [n for n, v in named.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if non_finite:
        raise_non_finite(non_finite)
    cast_to = _export_torch_dtype(dtype)
    if cast_to is not None:
        cast, same = {}, {}
        for name, value in (model.state_dict() if state_dict is None else state_dict).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != cast_to:
                # One cast per storage: tied weights must still share it (save_pretrained drops aliases by pointer).
                key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                       tuple(value.stride()))
                if key not in same:
                    same[key] = value.detach().to(cast_to)
                value = same[key]
            cast[name] = value
        state_dict = cast
    with _unwrap_without_importing_deepspeed():
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if cast_to is not None:
        _stamp_config_dtype(tmp, cast_to)
    tokenizer.save_pretrained(tmp)
    replace_folder(tmp, out_dir)


def _export_torch_dtype(dtype):
    """fp32 / bf16 / fp16 (export.dtype) or a torch dtype -> torch dtype; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _stamp_config_dtype(folder: str, dtype: torch.dtype) -> None:
    """config.json's `dtype` = the dtype the weights were written in (the live config is left alone)."""
    import json

    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        data = json.load(fh)
    data.pop("torch_dtype", None)
    data["dtype"] = str(dtype).split(".")[-1]
    with open(path, "w") as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def replace_folder(tmp: str, out_dir: str) -> None:
    """Move a finished folder into place: an earlier export stays whole until the new one is complete."""
    old = out_dir + ".old"
    if os.path.exists(out_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def dense_config(config):
    """A copy of a model's config without bitsandbytes' quantization_config (QLoRA): the config of the merged,
    dense model that the export writes."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def write_adapter_folder(adapters, folder: str, tensors: dict, base_name_or_path) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained
    writes it) of `adapters` (models.lora.Adapters) with `tensors` under PEFT's keys; atomic like write_hf_folder."""
    from safetensors.torch import save_file

    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise_non_finite(bad)
    folder = os.path.abspath(folder)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, os.path.join(tmp, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = copy.deepcopy(adapters.config)
    config.inference_mode = True
    config.base_model_name_or_path = base_name_or_path
    config.target_modules = sorted(adapters.layers)
    config.save_pretrained(tmp)
    replace_folder(tmp, folder)
