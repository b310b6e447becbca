"""LoRA adapters through the peft library (peft=lora), as a model transform applied before any parallelism.

`inject` puts peft's LoRA layers into the Hugging Face model in place (`peft.inject_adapter_in_model`: the model
stays the same transformers object, so every strategy wraps it as before) and freezes everything but the
adapters and `peft.modules_to_save`. Names change as peft's do: a target's weight becomes
`<module>.base_layer.weight` beside `<module>.lora_A.default.weight` / `lora_B`, a saved module's copy is
`<module>.modules_to_save.default.*` (its frozen original `<module>.original_module.*`).

`Adapters` knows that layout and nothing distributed: it renames the base model's initial or pretrained tensors
to the injected names, gives the adapters seeded initial values (A as peft draws it, kaiming-uniform; B zero: the
adapted model starts as the base) that are the same whatever the strategy, builds a full tensor stream of the
merged model (W + alpha/r B A, what `merge_and_unload` computes) and writes the adapter as PEFT saves it
(`PeftModel.from_pretrained` loads it).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import re
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from models.init import meta_model
from models.plans import layer_pattern
from models.weights import CheckpointWeights
from tessera.errors import ModelError, one_line

# bitsandbytes, which peft imports, looks for an optional CPU kernel on the Hugging Face hub as it loads and warns
# when it cannot have it (offline, or not trusted); it then uses its own kernels: nothing for a user to do.
for _name in ("bitsandbytes.backends.cpu.ops", "kernels"):
    logging.getLogger(_name).setLevel(logging.ERROR)

ADAPTER = "default"  # peft's adapter name inside the model (one adapter per run)
_LORA = re.compile(r"^(.*)\.lora_([AB])\." + ADAPTER + r"\.(weight)$")
_BASE = ".base_layer."
_ORIGINAL = ".original_module."
_SAVED = ".modules_to_save." + ADAPTER + "."


def lora_config(p, base_name_or_path: Optional[str] = None):
    """peft's LoraConfig from the peft section (or, with peft.adapter, from the adapter's own config)."""
    from peft import LoraConfig

    if p.adapter:
        config = LoraConfig.from_pretrained(p.adapter)
        config.inference_mode = False
        return config
    targets = list(p.target_modules)
    return LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      modules_to_save=list(p.modules_to_save) or None, task_type="CAUSAL_LM",
                      base_model_name_or_path=base_name_or_path)


def inject(model: nn.Module, p, base_name_or_path: Optional[str] = None) -> "Adapters":
    """Put LoRA layers into `model` in place (on whatever device its parameters are, the meta device included)
    and freeze all but them. A ModelError names peft.target_modules when it matches nothing."""
    from peft import inject_adapter_in_model

    with _quiet_peft():
        try:
            inject_adapter_in_model(lora_config(p, base_name_or_path), model, adapter_name=ADAPTER)
        except ValueError as e:
            if "not found in the base model" in str(e) or "No modules were targeted" in str(e):
                raise ModelError(f"peft.target_modules={list(p.target_modules)} matches no module of "
                                 f"{model.config.model_type}; its linear layers: {', '.join(linear_names(model))}"
                                 ) from None
            raise ModelError(f"peft: {one_line(e)}") from None
    _refuse_adapted_parameters(model, p)
    return Adapters(model)


def _refuse_adapted_parameters(model: nn.Module, p) -> None:
    """peft adapts the fused 3-D experts of transformers 5's mixture-of-experts blocks as parameters (its
    ParamWrapper: `all-linear`, or the v4 names gate_proj/up_proj/down_proj, map onto them); Tessera's adapters
    (seeding, merged export, PEFT's adapter files) cover LoRA layers on modules only."""
    from peft.tuners.lora.layer import ParamWrapper

    def pattern(name):
        return layer_pattern(name.replace(".base_layer", ""))

    wrapped = {pattern(n) + "." + m.parameter_name for n, m in model.named_modules() if isinstance(m, ParamWrapper)}
    # a router subclassing nn.Linear that returns more than logits (Llama 4's, PhiMoE's): peft's layer takes its
    # output for a tensor
    wrapped |= {pattern(n) for n, m in model.named_modules()
                if not isinstance(m, ParamWrapper) and type(getattr(m, "base_layer", None)).__name__.endswith("Router")}
    if wrapped:
        raise ModelError(f"peft.target_modules={list(p.target_modules)} adapts parameters of "
                         f"{model.config.model_type}'s mixture-of-experts blocks ({', '.join(sorted(wrapped))}: the "
                         f"fused experts or the router), which Tessera's LoRA does not support; name the other "
                         f"layers, e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]")


def linear_names(model: nn.Module) -> List[str]:
    """The distinct last names of the model's linear layers (what peft.target_modules may name)."""
    from transformers.pytorch_utils import Conv1D

    found = dict.fromkeys(n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)))
    return sorted(found)


@contextlib.contextmanager
def _quiet_peft():
    """peft warns when it sets fan_in_fan_out for GPT-2's Conv1D itself: expected here, not the user's concern."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        yield


def base_name(name: str) -> Optional[str]:
    """The base model's name of an injected model's tensor (None for an adapter's A / B)."""
    if _LORA.match(name):
        return None
    for piece in (_BASE, _ORIGINAL, _SAVED):
        if piece in name:
            return name.replace(piece, ".")
    return name


def adapter_key(name: str) -> Optional[str]:
    """The key PEFT's save_pretrained gives a trained tensor (None: not part of the adapter)."""
    m = _LORA.match(name)
    if m:
        return f"base_model.model.{m.group(1)}.lora_{m.group(2)}.weight"
    if _SAVED in name:
        return "base_model.model." + name.replace(_SAVED, ".")
    return None


def full_shape(t: torch.Tensor) -> Tuple[int, ...]:
    """A parameter's shape in the model: a ZeRO-3 partition's full shape, a 4-bit weight's unpacked one."""
    quant_state = getattr(t, "quant_state", None)
    if quant_state is not None:
        return tuple(quant_state.shape)
    return tuple(getattr(t, "ds_shape", t.shape))


class Adapters:
    """The LoRA layout of an injected model: per adapted module its scaling and orientation, the names of what
    trains, and the renaming between the base model's names and the injected ones."""

    def __init__(self, model: nn.Module):
        from peft.tuners.lora import LoraLayer

        self.config = model.peft_config[ADAPTER]
        self.layers: Dict[str, Tuple[float, bool]] = {}  # module -> (alpha / r, fan_in_fan_out)
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                self.layers[name] = (float(module.scaling[ADAPTER]), bool(getattr(module, "fan_in_fan_out", False)))
        named = dict(model.named_parameters())
        self.trainable = [n for n, p in named.items() if p.requires_grad]
        self.shapes = {n: full_shape(named[n]) for n in self.trainable}
        self.by_base: Dict[str, List[str]] = {}
        for n in list(named) + [n for n, _ in model.named_buffers()]:
            base = base_name(n)
            if base is not None and base != n:
                self.by_base.setdefault(base, []).append(n)
        self.total = sum(math.prod(full_shape(p)) for p in named.values())
        self.trained = sum(math.prod(s) for s in self.shapes.values())

    def describe(self) -> str:
        c = self.config
        return (f"LoRA r={c.r} alpha={c.lora_alpha} on {len(self.layers)} modules: {self.trained / 1e6:.3f}M "
                f"trainable of {self.total / 1e6:.2f}M parameters ({100 * self.trained / max(self.total, 1):.2f}%)")

    @staticmethod
    def base_only(model: nn.Module, compute):
        """`compute()` with every adapter of `model` off (LoRA layers and modules_to_save run their base module) and
        the model in eval mode, then everything as it was: the base model's output (a preference objective's live
        reference). peft's `disable_adapters` flag is set directly: its enable_adapters() would also change which
        parameters require gradients."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
        training = model.training
        model.eval()
        for m in layers:
            m._disable_adapters = True
        try:
            return compute()
        finally:
            for m in layers:
                m._disable_adapters = False
            model.train(training)

    def summary(self) -> dict:
        """What a checkpoint records (a run may resume it only with the same adapters)."""
        c = self.config
        return {"method": "lora", "r": c.r, "alpha": c.lora_alpha, "modules": sorted(self.layers),
                "modules_to_save": sorted(c.modules_to_save or [])}

    # ---- initial values -----------------------------------------------------------------------------------
    def initial_values(self, seed: int, adapter_folder: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """{name: full fp32 tensor} of every adapter A / B: an adapter folder's, or seeded ones that do not depend on
        the strategy, the world size or the order of construction (each tensor has its own generator)."""
        if adapter_folder:
            return self._from_folder(adapter_folder)
        out = {}
        for name in self.trainable:
            m = _LORA.match(name)
            if not m:
                continue  # modules_to_save copies start from the base module's values
            if m.group(2) == "B":
                out[name] = torch.zeros(self.shapes[name])
            else:
                g = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16))
                value = torch.empty(self.shapes[name])
                nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=g)  # peft's default init of A
                out[name] = value
        return out

    def _from_folder(self, folder: str) -> Dict[str, torch.Tensor]:
        saved = read_adapter_tensors(folder)
        out = {}
        for name in self.trainable:
            key = adapter_key(name)
            if key in saved:
                out[name] = saved[key].float()
        return out

    def initial_units(self, units: Optional[Iterable[dict]], values: Dict[str, torch.Tensor]) -> Iterator[dict]:
        """Seeded init units of the base model (models/init.py) under the injected names, then the adapters'."""
        for unit in units or ():
            yield {n: v for k, v in unit.items() for n in self.by_base.get(k, [k])}
        yield values

    def pretrained(self, weights, values: Dict[str, torch.Tensor]) -> "AdaptedWeights":
        return AdaptedWeights(weights, self, values)

    # ---- export ------------------------------------------------------------------------------------------------
    def export_streams(self, named: Iterable[Tuple[str, torch.Tensor]], adapter: Dict[str, torch.Tensor]):
        """From a stream of the injected model's full tensors (every rank iterates; only the writer's are real,
        other ranks get empty tensors), the merged model's stream under the base names; the adapter's tensors are
        put into `adapter` under PEFT's keys on the way (on the writer)."""
        pending: Dict[str, dict] = {}
        for name, t in named:
            key = adapter_key(name)
            if key is not None and t.numel():
                adapter[key] = t.detach().to("cpu", copy=True)
            if _ORIGINAL in name:
                continue  # the trained copy of a saved module replaces it
            if _SAVED in name:
                yield name.replace(_SAVED, "."), t
                continue
            m = _LORA.match(name)
            module = m.group(1) if m else (name.split(_BASE)[0] if _BASE in name else None)
            if module is None or module not in self.layers:
                yield name, t
                continue
            if not m and not name.endswith(_BASE + "weight"):
                yield base_name(name), t  # a bias of an adapted layer: as it is
                continue
            parts = pending.setdefault(module, {})
            parts[m.group(2) if m else "W"] = t
            if len(parts) == 3:
                del pending[module]
                yield module + ".weight", self._merged(module, parts)
        if pending:
            raise RuntimeError(f"LoRA export: incomplete adapted modules {sorted(pending)[:3]}")

    def _merged(self, module: str, parts: dict) -> torch.Tensor:
        w, a, b = parts["W"], parts["A"], parts["B"]
        if not w.numel():
            return w  # not the writer
        scaling, fan_in_fan_out = self.layers[module]
        delta = (b.float() @ a.float()) * scaling
        if fan_in_fan_out:
            delta = delta.T
        return (w.float() + delta.to(w.device)).to(w.dtype)  # full_tensors gives 4-bit weights dequantized

    def check_adapter_folder(self, folder: str) -> List[str]:
        """Problems of starting from the adapter in `folder`: it must hold exactly this model's adapters, with
        their shapes (an adapter of another base model does not)."""
        try:
            saved = read_adapter_shapes(folder)
        except (OSError, ValueError) as e:
            return [f"peft.adapter={folder!r}: cannot read its weights ({one_line(e)})"]
        mine = {adapter_key(n): self.shapes[n] for n in self.trainable}
        missing = sorted(set(mine) - set(saved))
        extra = sorted(set(saved) - set(mine))
        wrong = sorted(k for k in set(mine) & set(saved) if tuple(saved[k]) != tuple(mine[k]))
        if not (missing or extra or wrong):
            return []
        detail = [f"{k} is {list(saved[k])} there and {list(mine[k])} here" for k in wrong[:2]]
        if extra:
            detail.append(f"{len(extra)} tensors this model has no place for (e.g. {extra[0]})")
        if missing:
            detail.append(f"{len(missing)} of the model's adapter tensors are missing (e.g. {missing[0]})")
        base = _adapter_base(folder)
        return [f"peft.adapter={folder!r} is an adapter for another base model"
                + (f" ({base})" if base else "") + ": " + "; ".join(detail)]


class AdaptedWeights(CheckpointWeights):
    """A pretrained checkpoint (models.weights.PretrainedWeights) read under the injected model's names: the base
    model's tensors from the checkpoint, the adapters' from their initial values."""

    def __init__(self, weights, adapters: Adapters, values: Dict[str, torch.Tensor]):
        self.weights, self.adapters, self.values = weights, adapters, values
        self.folder = weights.folder

    def key(self, name: str):
        return name if name in self.values else self.weights.key(base_name(name))

    def missing(self, names) -> list:
        return [n for n in names if n not in self.values and self.weights.key(base_name(n)) is None]

    def shape(self, name: str):
        return list(self.values[name].shape) if name in self.values else self.weights.shape(base_name(name))

    def read(self, name: str, index=None) -> torch.Tensor:
        if name in self.values:
            value = self.values[name]
            return value if index is None else value[index]
        return self.weights.read(base_name(name), index)

    def close(self) -> None:
        self.weights.close()


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what PEFT writes (safetensors only: a pickle is never read)


def read_adapter_tensors(folder: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, ADAPTER_WEIGHTS))


def read_adapter_shapes(folder: str) -> Dict[str, list]:
    from safetensors import safe_open

    path = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise OSError(f"no {ADAPTER_WEIGHTS} in it")
    with safe_open(path, "pt") as fh:
        return {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}


def _adapter_base(folder: str) -> str:
    try:
        with open(os.path.join(folder, "adapter_config.json")) as fh:
            return json.load(fh).get("base_model_name_or_path") or ""
    except (OSError, ValueError):
        return ""


def full_tensors(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter (tied ones once, 4-bit ones dequantized) and persistent buffer of a model
    held whole."""
    for name, p in model.named_parameters():
        yield name, dense(p)
    buffers = dict(model.named_buffers())
    for name in model.state_dict():  # the persistent buffers (a 4-bit weight's quantization state is not one)
        if name in buffers:
            yield name, buffers[name]


def dense(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values as a plain tensor: bitsandbytes' 4-bit weights (QLoRA) dequantized, others as they are."""
    quant_state = getattr(p, "quant_state", None)
    if quant_state is None:
        return p.detach()
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(p.data, quant_state).float()


def quantization_problems(device: torch.device) -> List[str]:
    """Whether bitsandbytes can hold a 4-bit base on `device`: installed, and a 4-bit round trip works there."""
    try:
        import bitsandbytes.functional as bnbf
    except Exception as e:  # noqa: BLE001 - not installed, or no build for this platform
        return [f"peft.quantization=nf4 needs bitsandbytes, which does not load here ({one_line(e)[:160]}); "
                f"pip install bitsandbytes, or set peft.quantization=none"]
    try:
        x = torch.randn(64, 64, device=device)
        packed, state = bnbf.quantize_4bit(x, quant_type="nf4")
        bnbf.dequantize_4bit(packed, state)
    except Exception as e:  # noqa: BLE001 - bitsandbytes has no 4-bit kernels for this device
        return [f"peft.quantization=nf4: bitsandbytes has no 4-bit support on {device} ({one_line(e)[:160]}); "
                f"use a device it supports (CUDA; the CPU with a recent bitsandbytes), or "
                f"peft.quantization=none"]
    return []


def model_problems(cfg, hf_config) -> List[str]:
    """peft=lora against the model, before any process group: targets that match nothing, modules_to_save that
    name no module, adapters on a head tied to the embedding, an adapter folder of another base model."""
    p = cfg.peft
    if p.name == "none":
        return []
    problems = []
    if p.adapter and os.path.isfile(os.path.join(p.adapter, "adapter_config.json")):  # else: config.peft_problems
        try:
            lora_config(p)
        except Exception as e:  # noqa: BLE001 - peft's own message on a bad adapter_config.json
            return [f"peft.adapter={p.adapter!r}: its adapter_config.json is not a LoRA config ({one_line(e)})"]
    elif p.adapter:
        p = copy.copy(p)
        p.adapter = None  # the folder's problem is reported already; check the rest without it
    model = meta_model(hf_config)
    tied = getattr(hf_config.get_text_config(), "tie_word_embeddings", False)
    try:
        adapters = inject(model, p)
    except ModelError as e:
        return [str(e)]
    for wanted in (p.modules_to_save if not p.adapter else []):
        if not any(n.startswith(f"{wanted}{_SAVED}") or f".{wanted}{_SAVED}" in n for n in adapters.trainable):
            problems.append(f"peft.modules_to_save names {wanted!r}, which is no module of "
                            f"{hf_config.model_type}")
    if tied:
        head = [n for n, m in model.named_modules() if m is model.get_output_embeddings()]
        embed = [n for n, m in model.named_modules() if m is model.get_input_embeddings()]
        touched = set(adapters.layers) | {base_name(n).rpartition(".")[0] for n in adapters.trainable
                                          if _SAVED in n}
        if touched & set(head + embed):
            problems.append(f"peft: {hf_config.model_type} ties its output head to the input embedding, so "
                            f"adapting or saving either would untie them; leave {', '.join(head + embed)} out of "
                            f"peft.target_modules and peft.modules_to_save")
    if p.adapter:
        problems += adapters.check_adapter_folder(p.adapter)
    return problems


def meta_adapted(hf_config, p) -> nn.Module:
    """The model with its adapters on the meta device (shapes and counts, no memory)."""
    model = meta_model(hf_config)
    if p.name != "none":
        inject(model, p)
    return model
