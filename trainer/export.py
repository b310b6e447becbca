"""Export a checkpoint as a Hugging Face model folder (safetensors + config + tokenizer).

    python -m trainer.export <checkpoint> <out dir>

<checkpoint> is a `step_<N>` folder, a run's `checkpoints/` folder or a run directory (then its newest complete
checkpoint). Whatever strategy and world size saved it, the result loads with
`AutoModelForCausalLM.from_pretrained(<out dir>)`. One process, no process group.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export_checkpoint(checkpoint: str, out_dir: str) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trainer import checkpoint as ckpt
    from trainer.strategies.base import write_hf_folder

    import transformers

    transformers.utils.logging.disable_progress_bar()
    path = ckpt.resolve(checkpoint, checkpoint, key="checkpoint")
    if path is None:
        raise ckpt.CheckpointError(f"{checkpoint}: no complete checkpoint")
    meta = ckpt.read_meta(path)
    ckpt.verify_files(path, meta)
    hf_dir = os.path.join(path, "hf_config")
    config = AutoConfig.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if meta.get("checkpoint_format") == "deepspeed":
        _export_deepspeed(path, config, tokenizer, out_dir)
        return path
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=ckpt.SafeFileSystemReader(path),
                 planner=ckpt.SafeLoadPlanner(), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise ckpt.CheckpointError(f"cannot read the model from {path}: {ckpt._short(e)}") from None
    model.load_state_dict(state["model"])
    model.tie_weights()
    write_hf_folder(model, tokenizer, out_dir)
    return path


def _export_deepspeed(path: str, config, tokenizer, out_dir: str) -> None:
    """ZeRO shards -> HF folder, one parameter at a time (DeepSpeed's lazy fp32 reconstruction), so the full
    fp32 model is never held at once. DeepSpeed's own files are pickles: export only checkpoints you trust."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from trainer.strategies.base import write_hf_folder_streaming

    with contextlib.redirect_stdout(io.StringIO()):  # its progress chatter
        lazy = get_fp32_state_dict_from_zero_checkpoint(path, tag="zero", lazy_mode=True)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(__import__("torch"), str(dtype).replace("torch.", "")) if dtype else None

    def tensors():
        for name, value in lazy.items():
            t = value.contiguous()
            yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t

    write_hf_folder_streaming(config, tokenizer, out_dir, tensors(), writer=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step_<N> folder, a checkpoints/ folder or a run directory")
    parser.add_argument("out_dir", help="where to write the Hugging Face model folder")
    args = parser.parse_args(argv)
    from trainer.errors import TesseraError

    try:
        path = export_checkpoint(args.checkpoint, args.out_dir)
    except TesseraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} to {os.path.abspath(args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
