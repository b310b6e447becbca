"""Context parallelism (`strategy.cp=N`): each sequence of a micro-batch is split over the N ranks of a context
group, which hold the same batch; FSDP shards the parameters over data x context ranks and sums their gradients,
so the gradient is the whole sequence's.

Sharding is load-balanced for causal attention: the sequence is cut into 2N chunks and rank r holds chunks r and
2N-1-r (an early and a late chunk, so every rank attends to about as many keys). Position ids follow the shard
(the model's rotary or learned positions see each token's real position); with `data.packing=documents` they are
the packed documents' own, restarting per document.

`cp_impl=ulysses` (any attention kernel, CPU included): around the model's attention function, one all-to-all
turns a rank's [its tokens, all heads] into [all tokens, its 1/N of the heads]; the kernel runs on whole sequences,
with a mask built here from the whole sequence's token order, documents and the layer's sliding window; a second
all-to-all returns [its tokens, all heads]. Needs heads (per tensor-parallel rank) divisible by N; key/value heads
divisible by N, or fewer that divide N (repeated: multi-query attention). Models that mix tokens outside attention
(linear attention, state-space scans, convolutions) are refused. `cp_impl=ring`: torch's context-parallel SDPA (ring
attention over the context group), causal attention of whole sequences only, on CUDA kernels.

The model's attention goes through transformers' attention interface under a name of our own (registered here),
so no mask is built by the model from the shard's positions; the first forward checks that the function was
called (a model whose attention bypasses the interface cannot be split, and would attend within shards only).

Pipeline stages (strategy.pp) run the rank's shard of the whole step's batch, several micro-batches' forwards (and
recomputations) interleaved: with packed documents each stage sets its micro-batch's documents around its forward
(`micro_batch`), and activation checkpointing recomputes a block with the documents its forward had
(`recompute_contexts`).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed._functional_collectives as funcol
from torch import nn

from models.init import decoder_blocks, text_config
from models.packing import takes_position_ids
from tessera.errors import ModelError
from trainer.data.datasets import IGNORE

INNER_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# Layer types (config.layer_types) whose only token mixing is attention; others (linear_attention, mamba, conv)
# mix the sequence in layers of their own.
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "attention")


def cp_problems(cfg, info, dims, device_type: str) -> List[str]:
    """Whether this model, data and layout can be split over `strategy.cp` ranks (before any group starts)."""
    s, cp = cfg.strategy, dims.cp
    if cp == 1:
        return [] if s.cp_impl == "ulysses" else ["strategy.cp_impl=ring is read with strategy.cp > 1 only"]
    text = text_config(info.hf_config)
    problems = []
    if s.sequence_parallel:
        problems.append("strategy.sequence_parallel=true with strategy.cp > 1 is not supported (both split the "
                        "sequence); set strategy.sequence_parallel=false")
    if cfg.data.seq_len % (2 * cp):
        problems.append(f"data.seq_len={cfg.data.seq_len} must be divisible by 2 x strategy.cp = {2 * cp} (each "
                        f"rank holds an early and a late chunk of every sequence)")
    if not takes_position_ids(info.hf_config):
        problems.append(f"strategy.cp={cp}: the {text.model_type} model's forward takes no position_ids, so a "
                        f"shard of a sequence cannot be given its positions; use strategy.cp=1")
    impl = getattr(info.hf_config, "_attn_implementation", None) or "sdpa"
    if s.cp_impl == "ulysses":
        problems += _ulysses_problems(text, impl, cp, dims.tp)
    else:
        problems += _ring_problems(cfg, text, impl, device_type)
    return problems


def cp_model_problems(model: nn.Module, cp: int) -> List[str]:
    """Whether the model (on the meta device) mixes tokens only in its attention: a convolution over the sequence
    (Mamba, gated delta nets, short convolutions) or a linear-attention layer would run on a rank's shard alone and
    silently train another model."""
    if cp <= 1:
        return []
    config = text_config(model.config)
    others = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYERS))
    where = f"its {', '.join(others)} layers" if others else next(
        (f"{type(m).__name__} {block}.{sub}" for block, b in decoder_blocks(model) for sub, m in b.named_modules()
         if isinstance(m, nn.Conv1d)), None)
    if where is None:
        return []
    return [f"strategy.cp={cp}: the {config.model_type} model mixes tokens outside attention ({where}), which would "
            f"see only a rank's shard of each sequence; use strategy.cp=1"]


def _ulysses_problems(text, impl: str, cp: int, tp: int) -> List[str]:
    problems = []
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        problems.append(f"strategy.cp={cp} splits attention over the context ranks: the {text.model_type} model has "
                        f"no attention heads (num_attention_heads); use strategy.cp=1")
    elif heads % (tp * cp):
        problems.append(f"strategy.cp={cp} (cp_impl=ulysses) splits the attention heads of each tensor-parallel "
                        f"rank over the context ranks: the {text.model_type} model has {heads} attention heads, not "
                        f"divisible by strategy.tp x strategy.cp = {tp * cp}; use a degree that divides it or "
                        f"strategy.cp_impl=ring")
    elif (kv // tp) % cp and cp % (kv // tp):  # kv % tp: the tensor-parallel check says so
        # fewer key/value heads than context ranks are repeated (each rank gets the one its query heads read)
        problems.append(f"strategy.cp={cp} (cp_impl=ulysses) splits the key/value heads of each tensor-parallel "
                        f"rank over the context ranks, or repeats them where there are fewer: the "
                        f"{text.model_type} model has {kv} key/value heads, {kv}/strategy.tp={tp} per rank, which "
                        f"strategy.cp must divide or be divided by; change strategy.cp or strategy.tp")
    if impl not in INNER_KERNELS:
        problems.append(f"strategy.cp={cp}: attention implementation {impl!r} cannot be split (ulysses runs "
                        f"around {', '.join(INNER_KERNELS)}); set model.attn_implementation=sdpa")
    elif impl.startswith("flash") and _chunked(text):
        problems.append(f"strategy.cp={cp}: the {text.model_type} model's chunked attention layers need a mask, "
                        f"which {impl} does not take; set model.attn_implementation=sdpa")
    return problems


def _chunked(text) -> bool:
    return "chunked_attention" in (getattr(text, "layer_types", None) or ())


def _ring_problems(cfg, text, impl: str, device_type: str) -> List[str]:
    problems = []
    if device_type != "cuda":
        problems.append(f"strategy.cp_impl=ring needs CUDA attention kernels (torch's ring attention has none for "
                        f"the {device_type} device); use strategy.cp_impl=ulysses")
    if cfg.data.packing == "documents":
        problems.append("strategy.cp_impl=ring attends causally over whole sequences: data.packing=documents needs "
                        "strategy.cp_impl=ulysses")
    if getattr(text, "sliding_window", None) or getattr(text, "attn_logit_softcapping", None) or _chunked(text):
        problems.append(f"strategy.cp_impl=ring runs plain causal attention; the {text.model_type} model's sliding "
                        f"window, attention chunks or logit soft-capping need strategy.cp_impl=ulysses")
    if impl not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        problems.append(f"strategy.cp_impl=ring replaces SDPA: attention implementation {impl!r} is not one; "
                        f"set model.attn_implementation=sdpa")
    return problems


def shard_order(seq_len: int, cp: int) -> torch.Tensor:
    """The token indices the context ranks hold, rank after rank: rank r holds chunks r and 2cp-1-r."""
    chunk = seq_len // (2 * cp)
    parts = []
    for r in range(cp):
        parts += [torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
    return torch.cat(parts)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document number of each token of packed rows (a document starts where positions do not go on)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(1)


def _seq_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """[b, h, s, d] of this rank's tokens -> [b, h/n, n*s, d]: its 1/n of the heads over every rank's tokens
    (rank after rank, as `shard_order` lists them)."""
    b, h, s, d = x.shape
    x = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    x = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, None, None, group))
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """[b, n*s, h/n, d] (an attention output of this rank's heads) -> [b, s, h, d] of this rank's tokens."""
    b, total, hn, d = x.shape
    x = x.reshape(b, n, total // n, hn, d).permute(1, 0, 2, 3, 4).contiguous()
    x = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, None, None, group))
    return x.permute(1, 2, 0, 3, 4).reshape(b, total // n, n * hn, d)


class ContextParallel:
    """The context group of this rank: shards each micro-batch and runs the model's attention across it."""

    def __init__(self, mesh, impl: str):
        self.mesh, self.impl = mesh, impl
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.inner = "sdpa"  # the model's own attention implementation, which runs on whole sequences
        self.order = self.inverse = None  # of the batch in progress: natural index of each gathered token
        self.documents = self.positions = None  # [b, S] in natural order (documents: packed rows only)
        self.masks = {}  # of the batch in progress, per sliding window: every layer with that window shares one
        self.calls = 0
        self.verified = False

    def apply(self, model) -> None:
        """Route the model's attention through this group (transformers' attention interface, our name)."""
        from transformers import AttentionInterface  # start-up time: only runs with strategy.cp > 1

        self.inner = getattr(model.config, "_attn_implementation", None) or "sdpa"
        name = f"tessera_cp_{self.impl}"
        AttentionInterface.register(name, self._attention)
        model.config._attn_implementation = name

    @contextmanager
    def sharded(self, batch: dict):
        """This rank's shard of a micro-batch (on the device), while the model runs forward and backward on it:
        input ids, labels and position ids of its tokens (`shard_position_ids`: plain positions, the packed
        documents being kept apart here)."""
        ids, labels = batch["input_ids"], batch["labels"]
        rows, length = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(rows, length)
        pad = (-length) % (2 * self.size)  # a shorter batch (an evaluation's last) is padded at its end
        if pad:
            ids, labels = F.pad(ids, (0, pad)), F.pad(labels, (0, pad), value=IGNORE)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)], 1)
        rest = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids")}
        self.calls = 0
        if self.impl == "ring":
            with self._ring_context([ids, labels, positions]) as (ids, labels, positions):
                yield dict(rest, input_ids=ids, labels=labels, shard_position_ids=positions)
        else:
            packed = "position_ids" in batch
            self._set_order(length + pad, positions if packed else None, positions)
            mine = self.order.view(self.size, -1)[self.rank]
            if packed:  # whole rows, natural order: what a pipeline stage hands `micro_batch` for its rows
                rest["document_position_ids"] = positions
            yield dict(rest, input_ids=ids[:, mine], labels=labels[:, mine], shard_position_ids=positions[:, mine])
        self._check_called()

    def _set_order(self, length: int, packed: Optional[torch.Tensor], positions: torch.Tensor) -> None:
        self.order = shard_order(length, self.size).to(positions.device)
        self.inverse = torch.argsort(self.order)
        self.documents = None if packed is None else document_ids(packed)
        self.positions = positions
        self.masks = {}

    @contextmanager
    def micro_batch(self, document_position_ids: torch.Tensor):
        """While a pipeline stage runs one micro-batch of the sharded batch: its rows' packed documents (whole
        rows, natural order), so the attention masks them and not the whole batch's."""
        with self._state_restored((self.order, self.inverse, document_ids(document_position_ids),
                                   document_position_ids, {})):
            yield

    def recompute_contexts(self):
        """Activation checkpointing's `context_fn`, called at a block's forward: its recomputation in backward
        runs with the documents that forward had (a schedule runs other micro-batches' forwards in between)."""
        return nullcontext(), self._state_restored((self.order, self.inverse, self.documents, self.positions,
                                                    self.masks))

    @contextmanager
    def _state_restored(self, state):
        before = (self.order, self.inverse, self.documents, self.positions, self.masks)
        self.order, self.inverse, self.documents, self.positions, self.masks = state
        try:
            yield
        finally:
            self.order, self.inverse, self.documents, self.positions, self.masks = before

    @contextmanager
    def _ring_context(self, buffers):
        from torch.distributed.tensor.experimental import context_parallel  # only with cp_impl=ring (CUDA)

        buffers = [b.contiguous().clone() for b in buffers]  # sharded in place by torch
        with context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                              no_restore_buffers=set(buffers)):
            yield buffers

    def _check_called(self) -> None:
        if self.verified:
            return
        if not self.calls:
            raise ModelError("strategy.cp > 1: the model's attention does not go through transformers' attention "
                             "interface, so it cannot be split over the context ranks (each rank would attend "
                             "within its own shard only); use strategy.cp=1")
        self.verified = True

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank sum (loss, task sums) over the context group: each rank holds its tokens' part."""
        value = value.clone()
        dist.all_reduce(value, group=self.group)
        return value

    # ---- attention -------------------------------------------------------------------------------------------
    def _attention(self, module, query, key, value, attention_mask, **kwargs):
        self.calls += 1
        if self.impl == "ring":
            if kwargs.get("s_aux") is not None:
                raise ModelError(f"strategy.cp_impl=ring runs plain causal attention; {type(module).__name__} has "
                                 f"attention sinks: use strategy.cp_impl=ulysses")
            return _ring_attention(query, key, value, kwargs.get("scaling")), None
        n, g, heads = self.size, self.group, query.shape[1]
        key, value = _kv_for_every_rank(module, heads, key, value, n)
        q, k, v = (_seq_to_heads(x, g, n)[:, :, self.inverse] for x in (query, key, value))
        if self.inner.startswith("flash") and self.documents is not None:
            kwargs["position_ids"] = self.positions  # the varlen kernel finds the documents from them
        inner = self._inner_function(module)
        module, kwargs = _on_heads(module, kwargs, heads, slice(self.rank * heads // n, (self.rank + 1) * heads // n),
                                   q.shape[1] // k.shape[1])
        mask = self._mask(q, kwargs.get("sliding_window"), chunk_size(module))
        out, _ = inner(module, q, k, v, mask, **kwargs)
        return _heads_to_seq(out[:, self.order], g, n), None

    def _inner_function(self, module):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # loaded with the model already

        if self.inner == "eager":  # the model's own (soft-capping, sinks, ...), as its attention would call it
            inner = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if inner is None:
                raise ModelError(f"strategy.cp: {type(module).__name__} has no eager attention function to run "
                                 f"across the context ranks; set model.attn_implementation=sdpa")
            return inner
        return ALL_ATTENTION_FUNCTIONS[self.inner]

    def _mask(self, q: torch.Tensor, window: Optional[int], chunk: Optional[int]):
        """The whole sequence's mask in natural order: causal, inside each packed document, within the layer's
        sliding window or attention chunk; None where the kernel masks causally itself (SDPA without documents,
        window or chunk; flash)."""
        plain = self.documents is None and not window and not chunk
        if self.inner.startswith("flash") or (self.inner == "sdpa" and plain):
            return None
        key = (window, chunk, q.dtype)
        if key not in self.masks:
            self.masks[key] = self._build_mask(q, window, chunk)
        return self.masks[key]

    def _build_mask(self, q: torch.Tensor, window: Optional[int], chunk: Optional[int]) -> torch.Tensor:
        idx = torch.arange(q.shape[2], device=q.device)
        allowed = idx[None, :] <= idx[:, None]
        if window:
            allowed = allowed & (idx[:, None] - idx[None, :] < window)
        if chunk:  # Llama 4's chunked layers: keys of the query's own chunk of the sequence
            allowed = allowed & (idx[:, None] // chunk == idx[None, :] // chunk)
        allowed = allowed[None, None]
        if self.documents is not None:
            d = self.documents
            allowed = allowed & (d[:, None, :, None] == d[:, None, None, :])
        if self.inner == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed,
                                                                                      torch.finfo(q.dtype).min)


def chunk_size(module) -> Optional[int]:
    """The attention chunk of the module's layer (Llama 4's `chunked_attention` layers), else None. The blocks
    keep the whole model's config and their global layer index, also on a pipeline stage."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if index is None or not types or types[index] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


class _HeadsView:
    """An attention module as the kernel sees it on this rank's heads: its per-head parameters (attention sinks)
    sliced, everything else its own."""

    def __init__(self, module, sliced: dict):
        self._module, self._sliced = module, sliced

    def __getattr__(self, name):
        return self._sliced[name] if name in self._sliced else getattr(self._module, name)


def _kv_for_every_rank(module, heads: int, key: torch.Tensor, value: torch.Tensor, n: int):
    """Keys and values with a head count the n context ranks can split: fewer key/value heads than ranks (Falcon's
    multi-query attention, 1) are repeated so that each rank gets the one its query heads read (the repeats'
    gradients add up); query heads must divide."""
    kv = key.shape[1]
    if heads % n or (kv % n and n % kv):
        raise ModelError(f"strategy.cp={n} (cp_impl=ulysses): {type(module).__name__} runs {heads} query and {kv} "
                         f"key/value heads per rank; the query heads must divide by strategy.cp, and the key/value "
                         f"heads divide by it or it by them; change strategy.cp or strategy.tp")
    if kv % n == 0:
        return key, value
    return key.repeat_interleave(n // kv, dim=1), value.repeat_interleave(n // kv, dim=1)


def _on_heads(module, kwargs: dict, heads: int, mine: slice, groups: int):
    """The module and kernel arguments for this rank's `mine` of the `heads` query heads, `groups` query heads per
    key/value head on this rank: one value per head (gpt-oss's sinks, also passed as `s_aux`) sliced. Their
    gradient reaches the whole parameter, and each rank adds its heads' part as the gradients are summed over the
    context group."""
    own = {k: p for k, p in module.named_parameters(recurse=False)
           if k not in ("weight", "bias") and p.dim() >= 1 and p.shape[0] == heads}
    sliced = {} if getattr(module, "num_key_value_groups", groups) == groups else {"num_key_value_groups": groups}
    if not own and not sliced:
        return module, kwargs
    by_id = {id(p): p[mine] for p in own.values()}
    kwargs = {k: by_id.get(id(v), v) for k, v in kwargs.items()}
    return _HeadsView(module, {**sliced, **{k: by_id[id(p)] for k, p in own.items()}}), kwargs


def _ring_attention(query, key, value, scaling) -> torch.Tensor:
    """Causal SDPA on this rank's shard; torch's context-parallel dispatcher (active in `sharded`) turns it into
    ring attention over the context group. -> [b, s, h, d] as transformers' attention functions return."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous()


def sharded_or_whole(cp: Optional[ContextParallel], batch: dict):
    """`cp.sharded(batch)`, or the batch as it is without context parallelism."""
    return cp.sharded(batch) if cp is not None else nullcontext(batch)


def total_over(cp: Optional[ContextParallel], value: torch.Tensor) -> torch.Tensor:
    """`cp.total(value)`: a per-rank sum over the context group; the value as it is without context parallelism."""
    return cp.total(value) if cp is not None else value
