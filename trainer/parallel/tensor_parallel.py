"""Tensor parallelism as one function: `apply_tp(part, plan, tp_mesh, sequence_parallel)` splits a model's
modules by a plan of Hugging Face style names ({module path pattern: style}, models/plans.py) with DTensor, and
gives every parameter the plan leaves whole a replicated DTensor (the optimizer's and clipping's fused kernels
can't mix DTensors and plain tensors). Parameters that modules share (tied embeddings) stay shared."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from models.init import decoder_blocks, retie, shared_parameters, text_config
from models.plans import resolve_plan
from tessera.errors import ModelError
from trainer.observe import comm_bytes


def _styles(sequence_parallel: bool, rope_dim: Optional[int] = None) -> dict:
    sp = sequence_parallel
    return {
        # Sequence parallelism: outside attention and MLP the activations stay split over the sequence (dim 1);
        # the modules holding column-parallel projections gather it at their input (Hugging Face's attention
        # takes its shapes from its input), the row-parallel outputs reduce-scatter it.
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        # The input arrives whole (e.g. after a gathered column-parallel output): each rank takes its slice.
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if sp else RowwiseParallel(input_layouts=Replicate()),
        # Kept whole on every rank, but it works on this rank's heads only (Qwen3's per-head q/k norms): its
        # gradient is a partial sum that all tensor-parallel ranks add up.
        "replicated_with_grad_allreduce": lambda: _ReplicatedGradAllReduce(),
        # Mixture-of-experts blocks: Tessera keeps the experts whole on every rank (parameter-level plans such as
        # `packed_colwise` on the fused expert tensors are not applied); attention is still split.
        "moe_tp_experts": lambda: _WholeOnEveryRank(),
        # DeepSeek's multi-head latent attention: the joint key/value down-projection, kept whole.
        "mla_kv_a_proj": lambda: _MlaKvDownProjection(rope_dim),
    }


def _replicate_parameters(module, mesh) -> None:
    """The module's own plain parameters as replicated DTensors (one kind of parameter for the optimizer)."""
    for key, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            module.register_parameter(key, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()],
                                                                           run_check=False),
                                                        requires_grad=p.requires_grad))


def _ReplicatedGradAllReduce():
    """Parameters replicated; the input is this rank's share (its heads) of a larger tensor, so it enters as a
    DTensor sharded over a dimension the module does not reduce (the batch): DTensor then sums the weight's
    gradient over the ranks in backward (a partial sum all-reduced), also under FSDP."""
    class ReplicatedGradAllReduce(ParallelStyle):
        def _apply(self, module, device_mesh):
            def inputs(mod, args, mesh):
                return tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
                             if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in args)

            def outputs(mod, out, mesh):
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, device_mesh, lambda name, mod, mesh: _replicate_parameters(mod, mesh),
                                     input_fn=inputs, output_fn=outputs)

    return ReplicatedGradAllReduce()



class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward adds up the ranks' partial gradients (all-reduce over the group)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def _MlaKvDownProjection(rope_dim: Optional[int]):
    """DeepSeek's `kv_a_proj_with_mqa`, whole on every rank: the first columns of its output go through the
    column-parallel `kv_b_proj` (whose input gradient DTensor makes whole), the last `qk_rope_head_dim` (the
    rotary key all heads share) straight into this rank's heads: their gradient is a partial sum that the ranks
    add up, as Hugging Face's MlaKvAProjParallel does."""
    if not rope_dim:
        raise ModelError("the model's tensor-parallel plan splits a latent-attention key/value projection "
                         "(mla_kv_a_proj) but its config has no qk_rope_head_dim; set strategy.tp=1")

    class MlaKvDownProjection(ParallelStyle):
        def _apply(self, module, device_mesh):
            def outputs(mod, out, mesh):
                out = _local_outputs(mod, out, mesh)
                latent, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
                return torch.cat([latent, _SumGradOverRanks.apply(rope, mesh.get_group())], dim=-1)

            return distribute_module(module, device_mesh, lambda name, mod, mesh: _replicate_parameters(mod, mesh),
                                     input_fn=_replicated_inputs, output_fn=outputs)

    return MlaKvDownProjection()


def _WholeOnEveryRank(with_unsplit_children: bool = False):
    """A module kept whole on every rank that computes the same on each (mixture-of-experts experts: routing,
    grouped matmuls): parameters are replicated DTensors (one kind of parameter for the optimizer) but its
    forward runs on their local tensors, since DTensor has no rule (or a narrower one) for its data-dependent
    ops. The gradient comes back Replicate; every rank computed the same, so no reduction is needed.
    `with_unsplit_children`: so do the submodules the plan leaves whole, whose weights such a module may use
    directly (Qwen3.5's linear attention passes its conv1d's weight to a convolution function)."""
    class WholeOnEveryRank(ParallelStyle):
        def _apply(self, module, device_mesh):
            local = [m for m in module.modules() if m is module or with_unsplit_children and not any(
                isinstance(p, DTensor) for p in m.parameters(recurse=False))]
            for m in local:
                _replicate_parameters(m, device_mesh)

            # A plain tensor in a parameter's place: no public API registers one (setattr wants a Parameter).
            def local_params(mod, args, kwargs):
                saved = [(m, {k: p for k, p in m._parameters.items() if isinstance(p, DTensor)}) for m in local]
                mod._tessera_dtensor_params = saved
                for m, params in saved:
                    for k, p in params.items():
                        m._parameters[k] = p.to_local()  # differentiable: the gradient reaches the DTensor
                args = tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
                kwargs = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
                return args, kwargs

            def restore(mod, args, output):
                for m, params in mod._tessera_dtensor_params:
                    m._parameters.update(params)
                mod._tessera_dtensor_params = []
                return output

            module.register_forward_pre_hook(local_params, with_kwargs=True)
            module.register_forward_hook(restore)
            return module

    return WholeOnEveryRank()


def apply_tp(part: nn.Module, plan: dict, tp_mesh, sequence_parallel: bool) -> None:
    ties = shared_parameters(part)
    config = text_config(part.config)
    styles = _styles(sequence_parallel, getattr(config, "qk_rope_head_dim", None))
    unknown = sorted({st for st in plan.values() if st not in styles})
    if unknown:
        raise ModelError(f"the model's tensor-parallel plan uses style(s) {', '.join(map(repr, unknown))}, which "
                         f"Tessera does not apply (supported: {', '.join(styles)}); set strategy.tp=1")
    resolved = {n: styles[st]() for n, st in resolve_plan(part, plan).items()}
    grad_allreduce = {n for n, st in resolve_plan(part, plan).items() if st == "replicated_with_grad_allreduce"}
    if sequence_parallel:
        gather_at = {n.rpartition(".")[0] for n, st in resolved.items() if isinstance(st, ColwiseParallel)}
        gather_at = {n for n in gather_at if n and any(n.startswith(b + ".") for b, _ in decoder_blocks(part))}
        hook = _sequence_gather_hook(tp_mesh)
        for n in gather_at:
            part.get_submodule(n).register_forward_pre_hook(hook, with_kwargs=True)
        blocks = decoder_blocks(part)
        for name, block in blocks:  # the blocks' own norms (on the residual stream) work on sequence shards;
            for sub_name, sub in block.named_children():  # norms inside attention see the gathered sequence
                full = f"{name}.{sub_name}"
                if full in grad_allreduce:
                    continue
                if "norm" in type(sub).__name__.lower() and any(True for _ in sub.parameters(recurse=False)):
                    resolved[full] = SequenceParallel(use_local_output=True)
        # The model's own code (masks, positions) sees whole sequences: split them entering this stage's
        # first block, gather them leaving its last.
        resolved[blocks[0][0]] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                    desired_input_layouts=(Shard(1),), use_local_output=True)
        last = blocks[-1][0]
        if last == blocks[0][0]:
            parallelize_module(part.get_submodule(last), tp_mesh, resolved.pop(last))
        resolved[last] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    parallelize_module(part, tp_mesh, resolved)
    for name, style in resolved.items():
        if ".shared_expert." in name and isinstance(style, RowwiseParallel):
            # Llama 4's MoE block adds the routed experts into its shared expert's output in place, which the
            # view a DTensor hands out as its local tensor does not allow: that output is a copy.
            part.get_submodule(name).register_forward_hook(lambda mod, args, out: out.clone())
    _replicate_the_rest(part, tp_mesh)
    retie(ties)  # distribute_module gives each module its own DTensor parameter


def _sequence_gather_hook(tp_mesh):
    """Forward pre-hook: the sequence-split hidden states (first argument or `hidden_states=`) made whole (an
    all-gather whose backward reduce-scatters)."""
    def whole(x):
        d = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
        return d.redistribute(tp_mesh, [Replicate()]).to_local()

    def hook(module, args, kwargs):
        if args:
            args = (whole(args[0]), *args[1:])
        elif "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=whole(kwargs["hidden_states"]))
        return args, kwargs

    return hook


def _replicated_inputs(mod, inputs, mesh):
    """distribute_module's input_fn: plain tensor arguments as replicated DTensors."""
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_outputs(mod, outputs, mesh):
    """distribute_module's output_fn: one tensor, or several (Llama 4's router: scores and logits), as plain ones."""
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _replicate_the_rest(part, tp_mesh) -> None:
    """Modules the plan leaves whole (norms; embeddings/head when not split) get their parameters as replicated
    DTensors, taking and returning plain tensors."""
    done = set()
    for module in list(part.modules()):
        own = [p for p in module.parameters(recurse=False)]
        if own and not all(isinstance(p, DTensor) for p in own) and not all(id(p) in done for p in own):
            if any(True for c in module.children() for _ in c.parameters()):
                # A module with parameters of its own beside its children's (attention sinks, linear attention):
                # its forward mixes them with its children's plain outputs (or uses the weights of children the
                # plan leaves whole), so it runs on their local tensors.
                parallelize_module(module, tp_mesh, _WholeOnEveryRank(with_unsplit_children=True))
                done.update(id(p) for p in module.parameters())
            else:
                distribute_module(module, tp_mesh, input_fn=_replicated_inputs, output_fn=_local_outputs)
                done.update(id(p) for p in module.parameters(recurse=False))


def grads_in_param_layout(module) -> None:
    """Hooks, set after materialization (which makes new parameter objects): each DTensor parameter's gradient in
    the parameter's own layout. Torch's embedding backward returns the vocabulary-split weight's gradient
    Replicate: without this every rank would hold the whole embedding gradient until the step (Replicate ->
    Shard keeps the local slice, no communication); a replicated parameter's partial gradient is summed.
    FSDP2 does the same for the parameters it manages."""
    def layout_hook(param):
        def to_param_layout(grad):
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                return grad.redistribute(param.device_mesh, param.placements)
            return grad
        return to_param_layout

    for p in module.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_hook(layout_hook(p))


# DTensor's functional collectives (what redistributing a tensor-parallel activation or gradient calls):
# function -> (kind, argument counted; "*": the result), as trainer/observe/comm_bytes.py counts torch.distributed's.
FUNCTIONAL_COLLECTIVES = {
    "all_reduce": ("all_reduce", "self"), "all_reduce_coalesced": ("all_reduce", "self"),
    "all_gather_single": ("all_gather", "*"), "all_gather_tensor": ("all_gather", "*"),
    "all_gather_tensor_autograd": ("all_gather", "*"), "reduce_scatter_single": ("reduce_scatter", "self"),
    "reduce_scatter_tensor": ("reduce_scatter", "self"), "reduce_scatter_tensor_autograd": ("reduce_scatter", "self"),
    "all_to_all_single": ("all_to_all", "self"), "broadcast": ("broadcast", "self"),
}


def count_functional_collectives() -> None:
    """comm_bytes for DTensor's redistributions: they call torch's functional collectives (a private module,
    reached through its module attributes), not torch.distributed's functions. Nothing unless
    logging.comm_bytes=true (comm_bytes.install() ran)."""
    comm_bytes.wrap(funcol, FUNCTIONAL_COLLECTIVES)
