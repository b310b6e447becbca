"""The model in training written as a Hugging Face folder (hf/ at the end, snapshots/ while training), from the
strategy's public surface: `full_tensors()` (collective where the model is sharded), `hf_config`, `adapters`
and whether each rank holds the whole model. Every rank calls; rank 0 writes, atomically (trainer/exporting/
hf_folder.py)."""
from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from trainer.exporting.hf_folder import dense_config, write_adapter_folder, write_hf_folder, write_hf_folder_streaming


def export_hf(strategy, cfg, out_dir: str, tokenizer, adapter_dir: Optional[str] = None) -> List[str]:
    """Write the model into `out_dir` (peft=lora: the merged model, and the adapter alone into `adapter_dir` when
    given) in export.dtype. A model each rank holds whole is saved by rank 0 alone; a sharded one streams one
    full tensor at a time, so no rank holds the whole model. Returns the folders written."""
    writer = not dist.is_initialized() or dist.get_rank() == 0
    folders = [out_dir]
    if strategy.adapters is not None:
        adapter = {}
        streams = strategy.adapters.export_streams(strategy.full_tensors(), adapter)
        write_hf_folder_streaming(dense_config(strategy.hf_config), tokenizer, out_dir, streams, writer,
                                  dtype=cfg.export.dtype, generation_config=strategy.generation_config)
        if writer and adapter_dir:
            write_adapter_folder(strategy.adapters, adapter_dir, adapter, cfg.model.name_or_path)
        folders += [adapter_dir] if adapter_dir else []
    elif strategy.caps.holds_whole_model:
        if writer:
            write_hf_folder(strategy.unwrapped(), tokenizer, out_dir, dtype=cfg.export.dtype)
    else:
        write_hf_folder_streaming(strategy.hf_config, tokenizer, out_dir, strategy.full_tensors(), writer,
                                  dtype=cfg.export.dtype, generation_config=strategy.generation_config)
    if dist.is_initialized():
        dist.barrier()
    return folders
