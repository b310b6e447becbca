"""Parallelism as functions over one validated ParallelDims: apply_fsdp, apply_tp, the pipeline split, local
SGD/DiLoCo synchronisation and torchft replica groups. Strategies compose these; nothing here names a strategy."""
