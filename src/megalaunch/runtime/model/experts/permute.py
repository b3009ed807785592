"""Token permutation for dropless top-k routing without atomics: Megatron's unfused `permute` gathers each token's
k copies into expert order (`index_select`), and its backward and `unpermute` scatter them back with `index_add` /
`scatter_add`: bf16 atomics, rounded once per copy, ~20 % of a fine-grained MoE step on an H200
(docs/results.md). With dropless routing every token has exactly k copies, so the way back is a gather too: the
inverse map `inv[T, k]` (the k positions of each token in expert order) turns both "scatter-add" directions into
a gather and a sum of k rows per token (`index_select`, `sum`), accumulated in fp32 and rounded once.

Installed for the all-to-all dispatcher (`install`, with grouped experts): its `dispatch_preprocess` tells
`permute` the router's k when the routing is dropless (no capacity factor, no padding for quantization, no
drop-and-pad); `permute` then computes the same order as Megatron's (same outputs, bit for bit, in the forward)
and attaches `inv` to the sorted indices it returns; `unpermute` uses it when it finds it. With one expert-parallel
and tensor-parallel rank, the dispatcher's `sort_chunks_by_idxs` of the rows by local expert is an identity (a
split and a concatenation of every routed row, each way, after a host sync for the sizes): skipped. Every other
call (the all-gather dispatcher, token dropping, TE's fused kernels, a real reordering) goes to Megatron's
functions unchanged.

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

import threading
from typing import Any

_ROUTING = threading.local()  # .topk: the dispatcher's k while its dispatch_preprocess runs (dropless), else None
_INSTALLED: list[bool] = []
INVERSE = "_megalaunch_inverse"


def _functions() -> tuple[Any, Any]:
    import torch

    def bag(x: Any, inv: Any) -> Any:
        """out[t] = sum_j x[inv[t, j]]: a gather and a sum over k (fp32 accumulation, rounded once). Not
        `embedding_bag`: its bf16 kernel ran at ~1/20 of the memory bandwidth on an H200 (docs/results.md). Not
        torch.compile'd into one kernel either: its indirect loads ran slower than the pair for moe-3b on an H200
        (2.70 ms against 1.96 for 65k tokens, top-8; bench/moe_ops.py)."""
        return x.index_select(0, inv.reshape(-1)).view(*inv.shape, x.shape[-1]).sum(1)

    class Scatter(torch.autograd.Function):
        """tokens[T, H] -> tokens[order] ([T k, H]); backward: each token's k gradients summed by gather."""

        @staticmethod
        def forward(ctx: Any, tokens: Any, order: Any, inv: Any) -> Any:
            ctx.save_for_backward(inv)
            return tokens.index_select(0, order)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (inv,) = ctx.saved_tensors
            return bag(grad.contiguous(), inv), None, None

    class Combine(torch.autograd.Function):
        """expert rows [T k, H] -> tokens [T, H], each token the sum of its k rows; backward: a gather."""

        @staticmethod
        def forward(ctx: Any, rows: Any, order: Any, inv: Any) -> Any:
            ctx.save_for_backward(order)
            return bag(rows.contiguous(), inv)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (order,) = ctx.saved_tensors
            return grad.index_select(0, order), None, None

    return Scatter, Combine


_FUNCS: list[Any] = []


def _funcs() -> tuple[Any, Any]:
    if not _FUNCS:
        _FUNCS.extend(_functions())
    return _FUNCS[0], _FUNCS[1]


def permute_dropless(tokens: Any, routing_map: Any, probs: Any, k: int) -> tuple[Any, Any, Any]:
    """Megatron's argsort permutation of a routing map with exactly k experts per token: (rows in expert order,
    their probabilities, the sorted token indices with the inverse map attached)."""
    import torch

    num_tokens = tokens.shape[0]
    flat_sorted = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_tokens * k]
    order = flat_sorted % num_tokens
    inv = torch.argsort(order, stable=True).view(num_tokens, k)  # each token's k positions, ascending
    scatter, _ = _funcs()
    rows = scatter.apply(tokens, order, inv)
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted] if probs is not None else None
    setattr(order, INVERSE, inv)
    return rows, permuted_probs, order


def combine_dropless(rows: Any, order: Any) -> Any:
    """The inverse of `permute_dropless`: each token the sum of its k expert rows."""
    _, combine = _funcs()
    return combine.apply(rows, order, getattr(order, INVERSE))


def _identity(order: Any) -> bool:
    """Whether a chunk order (a CPU tensor: Megatron keeps it there without TE) is 0, 1, 2, ...: then Megatron's
    `sort_chunks_by_idxs` would split the rows and concatenate them back as they were (a full copy of every routed
    row, four per layer and micro-batch, and a host sync for the split sizes)."""
    import torch

    if not isinstance(order, torch.Tensor) or order.device.type != "cpu":
        return False  # never a device sync to decide
    return bool(torch.equal(order, torch.arange(order.numel(), dtype=order.dtype)))


def install() -> bool:
    """Route the all-to-all dispatcher's dropless permutations through the gathers above (idempotent); False when
    this Megatron has no such dispatcher (nothing changed)."""
    if _INSTALLED:
        return True
    try:
        from megatron.core.transformer.moe import token_dispatcher as td
    except ImportError:
        return False
    if not all(hasattr(td, n) for n in ("permute", "unpermute", "MoEAlltoAllTokenDispatcher")):
        return False
    megatron_permute, megatron_unpermute = td.permute, td.unpermute
    dispatch_preprocess = td.MoEAlltoAllTokenDispatcher.dispatch_preprocess

    def permute(tokens: Any, routing_map: Any, probs: Any = None, num_out_tokens: Any = None, fused: bool = False,
                drop_and_pad: bool = False, **kw: Any) -> Any:
        k = getattr(_ROUTING, "topk", None)
        if k and not fused and not drop_and_pad and not kw.get("align_size") and \
                isinstance(num_out_tokens, int) and num_out_tokens == tokens.shape[0] * k:
            rows, permuted_probs, order = permute_dropless(tokens, routing_map, probs, k)
            return rows, permuted_probs, order, None, kw.get("tokens_per_expert")
        return megatron_permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                drop_and_pad=drop_and_pad, **kw)

    def unpermute(permuted_tokens: Any, sorted_indices: Any, restore_shape: Any, probs: Any = None,
                  routing_map: Any = None, fused: bool = False, drop_and_pad: bool = False, **kw: Any) -> Any:
        if probs is None and not fused and not drop_and_pad and getattr(sorted_indices, INVERSE, None) is not None \
                and kw.get("pad_offsets") is None:
            return combine_dropless(permuted_tokens, sorted_indices).view(restore_shape)
        return megatron_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                                  fused=fused, drop_and_pad=drop_and_pad, **kw)

    def preprocess(self: Any, hidden_states: Any, routing_map: Any, probs: Any) -> Any:
        cfg = self.config
        dropless = not self.drop_and_pad and cfg.moe_expert_capacity_factor is None and \
            not cfg.moe_router_padding_for_quantization and not cfg.moe_permute_fusion
        _ROUTING.topk = cfg.moe_router_topk if dropless else None
        try:
            return dispatch_preprocess(self, hidden_states, routing_map, probs)
        finally:
            _ROUTING.topk = None

    megatron_sort: Any = getattr(td, "sort_chunks_by_idxs", None)

    def sort_chunks_by_idxs(input: Any, split_sizes: Any, sorted_idxs: Any, probs: Any = None,
                            fused: bool = False) -> Any:
        if not fused and _identity(sorted_idxs):  # one expert-parallel rank: the chunks are in order already
            return input, probs
        return megatron_sort(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    if megatron_sort is not None:
        td.sort_chunks_by_idxs = sort_chunks_by_idxs
    td.permute, td.unpermute = permute, unpermute
    td.MoEAlltoAllTokenDispatcher.dispatch_preprocess = preprocess
    _INSTALLED.append(True)
    return True
