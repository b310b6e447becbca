"""Export a checkpoint as a Hugging Face model folder (safetensors + config + tokenizer).

    python -m trainer.export <checkpoint> <out dir> [--dtype fp32|bf16|fp16]

<checkpoint> is a `step_<N>` folder, a run's `checkpoints/` folder or a run directory (then its newest complete
checkpoint). Whatever strategy and world size saved it, the result loads with
`AutoModelForCausalLM.from_pretrained(<out dir>)`. One process, no process group. The weights written are the
fp32 master weights cast to the run's `export.dtype` (read from the checkpoint's config.yaml; fp32 when it has
none), or to `--dtype`: the same weights, in the same dtype, as the run's own end-of-run `hf/` export.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from models import lora, registry
from tessera.errors import EXIT_BAD_INPUT, EXIT_FAULT, ModelError, TesseraError, one_line
from trainer.checkpoint import manager as ckpt
from trainer.checkpoint.manager import CheckpointError
from trainer.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, checked_deepspeed_folder
from trainer.exporting.hf_folder import dense_config, write_adapter_folder, write_hf_folder, write_hf_folder_streaming
from trainer.run.cli import debug_traceback, fault_message, unwritable
from trainer.run.precision import DTYPES as PRECISION_DTYPES

DTYPES = tuple(PRECISION_DTYPES)  # the names export.dtype takes


def _run_value(path: str, key: str, default, hint: str = ""):
    """`key` of the config of the run that saved the checkpoint folder `path` (its config.yaml); `default` if it has
    none. A file that cannot be read is a CheckpointError (`hint`: what to do instead)."""
    config = os.path.join(path, "config.yaml")
    if not os.path.isfile(config):
        return default
    try:
        return OmegaConf.select(OmegaConf.load(config), key, default=default)
    except Exception as e:  # noqa: BLE001 - a damaged YAML file
        raise CheckpointError(f"{config}: cannot read it ({one_line(e)}){hint}") from None


def checkpoint_export_dtype(path: str) -> str:
    """export.dtype of the run that saved the checkpoint folder `path` (its config.yaml); fp32 if it has none."""
    dtype = _run_value(path, "export.dtype", "fp32", hint="; pass --dtype")
    if dtype not in DTYPES:
        raise CheckpointError(f"{os.path.join(path, 'config.yaml')}: export.dtype={dtype!r} is not one of "
                              f"{', '.join(DTYPES)}; pass --dtype")
    return dtype


def trusts_remote_code(path: str) -> bool:
    """model.trust_remote_code of the run that saved the checkpoint folder `path`: a remote-code model's files are
    then in hf_config/, copied there by the save."""
    return bool(_run_value(path, "model.trust_remote_code", False))


def export_checkpoint(checkpoint: str, out_dir: str, dtype: str | None = None,
                      adapter_dir: str | None = None) -> tuple:
    """Write the checkpoint's fp32 master weights, cast to `dtype` (None: the run's export.dtype), as an HF
    folder. A peft=lora checkpoint: the merged model there and the adapter into `adapter_dir` (default
    `<out_dir>-adapter`). Returns (the checkpoint folder exported, the folders written)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    path = ckpt.resolve(checkpoint, checkpoint, key="checkpoint")
    if path is None:
        raise ckpt.CheckpointError(f"{checkpoint}: no complete checkpoint")
    meta = ckpt.read_meta(path)
    ckpt.verify_files(path, meta, checksums=True)
    if dtype is None:
        dtype = checkpoint_export_dtype(path)
    hf_dir = os.path.join(path, "hf_config")
    trusted = trusts_remote_code(path)
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trusted)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    generation = _generation_config(hf_dir, config)
    if meta.get("peft"):
        adapter_dir = adapter_dir or out_dir.rstrip("/") + "-adapter"
        _export_lora(path, meta, config, generation, tokenizer, out_dir, dtype, adapter_dir)
        return path, [out_dir, adapter_dir]
    if meta.get("checkpoint_format") == "deepspeed":
        _export_deepspeed(path, config, generation, tokenizer, out_dir, dtype)
        return path, [out_dir]
    # DCP holds the fp32 master weights: read them into an fp32 model (whatever dtype its config names).
    with torch.device("meta"):
        # remote code: the checkpoint's own copy (hf_config/), as the run trusted it; a native class whose config
        # still names remote code (auto_map) stays native unless the run trusted the code
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trusted)
    model = model.to_empty(device="cpu")
    model.generation_config = generation
    state = {"model": model.state_dict()}
    _read_dcp(state, path, "the model")
    model.load_state_dict(state["model"])
    model.tie_weights()
    write_hf_folder(model, tokenizer, out_dir, dtype=dtype)
    return path, [out_dir]


def _generation_config(hf_dir: str, config):
    """The run's generation config, saved beside its config (the source's sampling defaults and stop tokens); a
    checkpoint saved before it was kept there: the one derived from config.json, as the model itself would have."""
    from transformers import GenerationConfig

    if os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
        return GenerationConfig.from_pretrained(hf_dir)
    return GenerationConfig.from_model_config(config)


def _read_dcp(state: dict, path: str, what: str) -> None:
    """Fill `state` from the DCP checkpoint `path` on this one process (its files are read weights-only)."""
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                 no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise ckpt.CheckpointError(f"cannot read {what} from {path}: {one_line(e)}") from None


def _export_deepspeed(path: str, config, generation, tokenizer, out_dir: str, dtype: str) -> None:
    """ZeRO shards -> HF folder, one parameter at a time (DeepSpeed's lazy fp32 reconstruction of the master
    weights), so the full fp32 model is never held at once. DeepSpeed's own files are pickles: each is checked
    weights-only against an exact allow-list first, and DeepSpeed's reads are weights-only (trainer/checkpoint/safe_load.py)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint


    with checked_deepspeed_folder(path):  # the lazy tensors read their files while they are written out
        with contextlib.redirect_stdout(io.StringIO()):  # its progress chatter
            lazy = get_fp32_state_dict_from_zero_checkpoint(path, tag="zero", lazy_mode=True)

        def tensors():
            for name, value in lazy.items():
                yield name, value.contiguous()

        write_hf_folder_streaming(config, tokenizer, out_dir, tensors(), writer=True, dtype=dtype,
                                  generation_config=generation)


def _export_lora(path: str, meta: dict, config, generation, tokenizer, out_dir: str, dtype: str,
                 adapter_dir: str) -> None:
    """A LoRA checkpoint holds the adapters only: the base is built again as the run built it (the pretrained
    folder named by its config.yaml, in 4 bits for QLoRA, or the seeded preset), the adapters are read into it, and
    the merged model and the adapter are written as the run's own export writes them."""
    run = OmegaConf.load(os.path.join(path, "config.yaml"))
    config = dense_config(config)  # QLoRA: quantized again as the run did (registry.build); written dense
    try:
        model = registry.build(run.model, SimpleNamespace(hf_config=config), seed=int(run.train.seed),
                               quantization=OmegaConf.select(run, "peft.quantization", default="none"),
                               quantize_on="cpu")
    except ModelError as e:  # the base is gone or unreadable
        raise ckpt.CheckpointError(f"{path} holds LoRA adapters only, and the base model they adapt cannot be "
                                   f"built again ({e}); the base is needed to export") from None
    adapters = lora.inject(model, SimpleNamespace(adapter=os.path.join(path, "hf_config")))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if meta.get("checkpoint_format") == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with checked_deepspeed_folder(path), contextlib.redirect_stdout(io.StringIO()):
            saved = get_fp32_state_dict_from_zero_checkpoint(path, tag="zero")
        missing = sorted(set(trained) - set(saved))
        if missing:
            raise ckpt.CheckpointError(f"{path} lacks {len(missing)} adapter tensors (e.g. {missing[0]})")
        with torch.no_grad():
            for n, p in trained.items():
                p.copy_(saved[n])
    else:
        _read_dcp({"model": {n: p.detach() for n, p in trained.items()}}, path, "the adapters")  # in place
    adapter = {}
    write_hf_folder_streaming(config, tokenizer, out_dir, adapters.export_streams(lora.full_tensors(model), adapter),
                              writer=True, dtype=dtype, generation_config=generation)
    write_adapter_folder(adapters, adapter_dir, adapter, run.model.name_or_path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step_<N> folder, a checkpoints/ folder or a run directory")
    parser.add_argument("out_dir", help="where to write the Hugging Face model folder")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the written weights (default: the run's export.dtype, fp32 if unset)")
    parser.add_argument("--adapter-dir", default=None,
                        help="a LoRA checkpoint (peft=lora): where the adapter goes (default: <out_dir>-adapter); "
                             "out_dir gets the merged model")
    args = parser.parse_args(argv)

    why = unwritable(args.out_dir)
    if why:
        print(f"error: the export folder {args.out_dir}: {why}; pass a writable out_dir", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        path, written = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype,
                                          adapter_dir=args.adapter_dir)
    except TesseraError as e:
        debug_traceback()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # disk full / read-only while writing: one line naming the path (exit 4)
        message = fault_message(e)
        if message is None:
            raise
        debug_traceback()
        print(f"error: {message}", file=sys.stderr)
        return EXIT_FAULT
    print(f"exported {path} to {' and '.join(os.path.abspath(w) for w in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
