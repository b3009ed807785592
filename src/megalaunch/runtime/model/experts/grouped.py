"""`GroupedExperts`: the local experts of one `MoELayer` as two 3D parameters, `weight1` [E_local, fc1 rows, hidden]
(fc1 rows: 2 x ffn_local with SwiGLU, the gate rows then the up rows, else ffn_local) and `weight2` [E_local, hidden,
ffn_local], each expert's slice exactly `SequentialMLP`'s `local_experts.e.linear_fc{1,2}.weight` (Linear's out x in
layout), computed with one grouped GEMM per linear layer (runtime/model/experts/gmm.py), or in FP8 under `precision: fp8`
(runtime/model/experts/fp8.py: `fp8_format` set by fp8_linear.install; the rows padded per expert to multiples of 16
on the device, both GEMMs run on the padded rows, one scatter in and one gather out).

What it keeps of `SequentialMLP` / `MLP`: the initialisation (Megatron's own initialisers per expert, fc1 then fc2,
in the same order and RNG streams, so one seed gives the same weights), the activation and the routing
probabilities multiplied after it (MLP's unfused path, its dtype handling included), expert tensor parallelism (fc1
split by columns, fc2 by rows; the dispatcher reduces the partial sums, as for SequentialMLP), the parameters'
expert-parallel marks (`allreduce`, tensor-parallel attributes) that route their gradients to the expert
data-parallel group, and the checkpoint layout (runtime/model/experts/sharded.py). Not supported: biases on the
experts and `moe_latent_size` (refused when built).

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from typing import Any

from megalaunch.runtime.model.experts import activation, fp8, sharded
from megalaunch.runtime.model.experts.gmm import gmm, grouped_mm_fn, shapes_fit

BIAS_FIX = ("set model.disable_bias_linear: true, or keep Megatron's SequentialMLP "
            "(MEGALAUNCH_MOE_EXPERTS=sequential or training.kernels: megatron)")


def refusal(config: Any) -> str | None:
    """Why GroupedExperts cannot build this config's experts (None: it can)."""
    if getattr(config, "add_bias_linear", False):
        return f"grouped experts take no bias (add_bias_linear): {BIAS_FIX}"
    if getattr(config, "moe_latent_size", None) is not None:
        return "grouped experts do not implement moe_latent_size: keep SequentialMLP (MEGALAUNCH_MOE_EXPERTS=sequential)"
    return None


def glu(h: Any, config: Any) -> Any:
    """MLP's activation on fc1's output (its unfused path: the same clamp and linear offset)."""
    import torch

    if not config.gated_linear_unit:
        return config.activation_func(h)
    gate, up = torch.chunk(h, 2, dim=-1)
    if (val := config.activation_func_clamp_value) is not None:
        gate = gate.clamp(min=None, max=val)
        up = up.clamp(min=-val, max=val)
    return config.activation_func(gate) * (up + config.glu_linear_offset)


def fp8_forward(module: Any, hidden: Any, tokens_per_expert: Any, probs: Any) -> Any:
    """The experts' forward with FP8 grouped GEMMs (`module.fp8_format` set): MLP's arithmetic on the padded rows
    (runtime/model/experts/fp8.py: zero rows between the groups, with zero probabilities), then back in order."""
    lay = fp8.layout(tokens_per_expert.to(device=hidden.device, non_blocking=True), hidden.shape[0])
    fused = module.fp8_format.fused
    inter = glu(fp8.fp8_gmm(fp8.pad(hidden, lay), module.weight1, lay.offs, fused), module.config)
    dtype = inter.dtype
    inter = (inter * fp8.pad(probs, lay).unsqueeze(-1)).to(dtype)
    return fp8.unpad(fp8.fp8_gmm(inter, module.weight2, lay.offs, fused), lay)


def bf16_forward(module: Any, hidden: Any, tokens_per_expert: Any, probs: Any) -> Any:
    """The experts' forward with torch's grouped GEMM: fc1, the activation times the probabilities, fc2."""
    import torch

    offs = tokens_per_expert.to(device=hidden.device, non_blocking=True).cumsum(0).to(torch.int32)
    h = gmm(hidden, module.weight1, offs, module.grouped)
    if activation.applies(h, module.config):  # one fused kernel each way (runtime/model/experts/activation.py)
        inter = activation.swiglu_probs(h, probs)
    else:
        inter = glu(h, module.config)
        dtype = inter.dtype  # MLP.forward: the activation times the probabilities, back in its dtype
        inter = (inter * probs.unsqueeze(-1)).to(dtype)
    return gmm(inter, module.weight2, offs, module.grouped)


def _groups(pg_collection: Any) -> Any:
    if pg_collection is not None:
        return pg_collection
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "expt_dp"])


def _initialise(module: Any, config: Any, tp_rank: int, tp_size: int) -> None:
    """Megatron's initialisers, per expert in SequentialMLP's order (fc1, fc2, next expert), on each expert's
    slice: ColumnParallelLinear's (fc1, split on rows, stride 2 with SwiGLU) and RowParallelLinear's (fc2, split
    on columns), on the CPU from the whole matrix or on the GPU in the expert-parallel RNG stream."""
    from megatron.core.tensor_parallel import layers

    stride1 = 2 if config.gated_linear_unit else 1
    hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
    for e in range(module.num_local_experts):
        for w, method, dim, stride, full in (
                (module.weight1, config.init_method, 0, stride1, (ffn * stride1, hidden)),
                (module.weight2, config.output_layer_init_method, 1, 1, (hidden, ffn))):
            view = w.data[e]
            if config.use_cpu_initialization:
                layers._initialize_affine_weight_cpu(view, full[0], full[1], view.shape[dim], dim, method,
                                                     stride=stride, rank=tp_rank, world_size=tp_size,
                                                     params_dtype=config.params_dtype)
            else:
                layers._initialize_affine_weight_gpu(view, method, partition_dim=dim, stride=stride, is_expert=True)


def _mark(module: Any, config: Any, tp_size: int) -> None:
    """The marks Megatron's expert linear layers carry: tensor-parallel attributes (fc1 split on its rows, axis 1
    here; fc2 on its columns, axis 2) and `allreduce=False` where expert parallelism or an expert TP other than TP
    sends the gradients to the expert data-parallel group (DDP's and the optimizer's expert buckets)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    own_groups = config.expert_model_parallel_size > 1 or \
        (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) != config.tensor_model_parallel_size
    for w, dim, stride in ((module.weight1, 1, 2 if config.gated_linear_unit else 1), (module.weight2, 2, 1)):
        set_tensor_model_parallel_attributes(w, is_parallel=True, dim=dim, stride=stride)
        w.allreduce = not own_groups


def _build_class() -> type:
    import torch
    from megatron.core.transformer.module import MegatronModule

    class GroupedExperts(MegatronModule):  # type: ignore[misc]
        """Megatron's experts interface (`forward(tokens, tokens_per_expert, probs)`, `backward_dw`,
        `sharded_state_dict`) on torch's grouped GEMM."""

        megalaunch_grouped_experts = True  # what fp8_linear.install and the tests look for

        def __init__(self, num_local_experts: int, config: Any, *, pg_collection: Any = None,
                     name: str | None = None) -> None:
            super().__init__(config=config)
            if (why := refusal(config)) is not None:
                raise ValueError(why)
            groups = _groups(pg_collection)
            self.num_local_experts = num_local_experts
            self.ep_group, self.tp_group, self.dp_group = groups.ep, groups.expt_tp, groups.expt_dp
            tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
            hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
            if ffn % tp_size:
                raise ValueError(f"moe_ffn_hidden_size {ffn} is not divisible by the expert TP size {tp_size}")
            local = ffn // tp_size
            rows = 2 * local if config.gated_linear_unit else local
            device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
            kw = dict(dtype=config.params_dtype, device=device)
            self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, rows, hidden, **kw))
            self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, local, **kw))
            if config.perform_initialization:
                _initialise(self, config, tp_rank, tp_size)
            _mark(self, config, tp_size)
            self.grouped = grouped_mm_fn() is not None and shapes_fit(hidden, local, config.params_dtype)
            self.fp8_format: Any = None  # fp8_linear.install: FP8 grouped GEMMs (not state: not in the checkpoint)

        def forward(self, hidden: Any, tokens_per_expert: Any, probs: Any, **_: Any) -> tuple[Any, None]:
            if self.config.moe_apply_probs_on_input:  # as SequentialMLP: the probabilities scale the input
                hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
                probs = torch.ones_like(probs)
            if self.fp8_format is not None:
                return fp8_forward(self, hidden, tokens_per_expert, probs), None
            return bf16_forward(self, hidden, tokens_per_expert, probs), None

        def backward_dw(self) -> None:
            """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (),
                               metadata: dict[str, Any] | None = None) -> dict[str, Any]:
            return sharded.experts_sharded_state_dict(self, prefix, sharded_offsets, metadata)

        def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
            sharded.stack_sequential_keys(state_dict, prefix, self.num_local_experts)
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    return GroupedExperts


_CLASS: list[type] = []


def grouped_experts_class() -> type:
    """The `GroupedExperts` class (defined on first use: it subclasses Megatron's module)."""
    if not _CLASS:
        _CLASS.append(_build_class())
    return _CLASS[0]


def experts_builder() -> Any:
    """What `MoESubmodules.experts` takes: `builder(num_local_experts, config, pg_collection=..., name=...)`."""
    return grouped_experts_class()


def with_grouped_experts(mlp: Any) -> Any:
    """The MoE layer's spec (`partial(MoELayer, submodules=MoESubmodules(...))`, or a ModuleSpec of it) with
    GroupedExperts as its experts; the router and the shared experts stay as they are."""
    import dataclasses
    import functools

    if isinstance(mlp, functools.partial) and hasattr(mlp.keywords.get("submodules"), "experts"):
        subs = dataclasses.replace(mlp.keywords["submodules"], experts=experts_builder())
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})
    if hasattr(getattr(mlp, "submodules", None), "experts"):
        return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts_builder()))
    raise ValueError(f"grouped experts: the layer's MLP spec {mlp!r} is not a mixture-of-experts layer's")
