"""Expert load in the job, on a mixture-of-experts run (the file and the collapse rule: moe_balance.py).

What it watches (megatron-core 0.19.2, `megatron.core.transformer.moe`):
- `router.TopKRouter.forward`: each training forward's routing map; its column sums (tokens per expert)
  are added to one device table of layers x (experts + 2) (with the dropped tokens and the routed slots),
  without a host sync. Only forwards with gradients on count: an evaluation's and the no-grad first pass of
  a recomputed layer are left out, so every token counts once (as Megatron's expert bias counts them).
- `router.apply_router_token_dropping` (capacity-factor runs): the routing map before the drop is the
  router's demand, what it kept tells the dropped tokens.
- `moe_logging.MoEMetricsTracker._aggregate`: Megatron's per-layer aux losses (load balancing, z-loss),
  after Megatron's own reduction across ranks, every iteration; added up on the device.

At each log interval, on every rank at the same step boundary (the seams' `on_iteration`, where the stop
decision's all-reduce follows): one all-reduce SUM of the table over all ranks (every rank routes tokens of
its own: data, context, expert and, with sequence parallelism, tensor parallel ranks; pipeline stages hold
different layers), then on rank 0 one copy to the host and one JSON line (RUN/state/moe_load.jsonl). Without
sequence parallelism the tensor-parallel ranks route the same tokens, so their sum is divided by TP."""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

from megalaunch.rundir.files import append_jsonl
from megalaunch.runtime.observation.moe_balance import max_over_mean
from megalaunch.runtime.rank.context import RankContext

_LOAD: MoeLoad | None = None  # this process's, which the patched router reports into
_DROPPED: list[Any] = []  # the current forward's (demand, kept) from the token dropping, if it ran


class MoeLoad:
    """One rank's expert-load accumulator; rank 0 writes the records."""

    def __init__(self, ctx: RankContext, *, layers: int, experts: int, topk: int, log_interval: int,
                 duplicates: int = 1) -> None:
        self.ctx = ctx
        self.layers, self.experts, self.topk = layers, experts, topk
        self.log_interval = log_interval
        self.duplicates = duplicates  # ranks that route the same tokens (TP without sequence parallelism)
        self.table: Any = None  # torch float64 [layers, experts + 2]: tokens per expert, dropped, routed slots
        self.aux: dict[str, Any] = {}  # Megatron's metric name -> per-layer sums over the interval (device)
        self.steps = 0  # Megatron's reports (one per iteration) in the interval

    def _table(self) -> Any:
        import torch

        if self.table is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            self.table = torch.zeros(self.layers, self.experts + 2, dtype=torch.float64, device=device)
        return self.table

    def routed(self, layer_number: int | None, routing_map: Any, topk: int) -> None:
        """A training forward of the router of `layer_number` (1-based, global): device adds only."""
        dropped = _DROPPED.pop() if _DROPPED else None
        if layer_number is None or not 1 <= layer_number <= self.layers or routing_map.shape[-1] != self.experts:
            return
        row = self._table()[layer_number - 1]
        demand = dropped[0] if dropped is not None else routing_map.sum(0)
        row[:self.experts] += demand
        if dropped is not None:
            row[self.experts] += demand.sum() - dropped[1]
        row[self.experts + 1] += routing_map.shape[0] * topk

    def tracked(self, values: dict[str, Any], loss_scale: float) -> None:
        """Megatron's per-layer aux losses of one iteration, already reduced across ranks."""
        for name, v in values.items():
            v = v.detach().double() * loss_scale
            self.aux[name] = v if name not in self.aux else self.aux[name] + v
        self.steps += 1

    def collect(self, iteration: int) -> dict[str, Any] | None:
        """Every rank, every iteration; at a log interval the one collective and, on rank 0, the record."""
        if iteration % self.log_interval:
            return None
        import torch
        import torch.distributed as dist

        table = self._table()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        names = sorted(self.aux)
        aux, steps = [self.aux[n].to(table.device).flatten() for n in names], self.steps
        flat = torch.cat([table.flatten(), *aux]).tolist() if self.ctx.is_zero else []  # the one host copy
        table.zero_()
        self.aux, self.steps = {}, 0
        if not self.ctx.is_zero:
            return None
        record = self._record(iteration, flat, names, steps)
        try:
            append_jsonl(self.ctx.paths.moe_load, record)
        except OSError as e:
            self.ctx.log(f"could not append to {self.ctx.paths.moe_load}: {e}")
        return record

    def _record(self, iteration: int, flat: list[float], names: list[str], steps: int) -> dict[str, Any]:
        width, n = self.experts + 2, self.layers * (self.experts + 2)
        losses = {name: flat[n + i * self.layers: n + (i + 1) * self.layers] for i, name in enumerate(names)}
        layers: list[dict[str, Any]] = []
        for i in range(self.layers):
            row = [round(v / self.duplicates) for v in flat[i * width:(i + 1) * width]]
            counts, dropped, slots = row[:self.experts], row[self.experts], row[self.experts + 1]
            if slots <= 0:
                continue  # a dense layer, or none routed
            mom = max_over_mean(counts)
            layers.append({"layer": i + 1, "tokens": slots // self.topk, "counts": counts, "dropped": dropped,
                           "max_over_mean": round(mom, 4) if mom is not None else None,
                           "aux": {k: v[i] / steps for k, v in losses.items()} if steps else {}})
        aux = {k: sum(la["aux"][k] for la in layers) / len(layers) for k in names} if layers and steps else {}
        return {"iteration": iteration, "job_id": self.ctx.job_id, "time": time.time(), "experts": self.experts,
                "topk": self.topk, "steps": steps, "layers": layers, "aux": aux}


def start(ctx: RankContext, log_interval: int) -> MoeLoad | None:
    """After Megatron parsed its arguments, before it builds the model: on an MoE run, the watch above."""
    global _LOAD
    megatron_training = sys.modules.get("megatron.training")
    if megatron_training is None:
        return None  # the torch-free stand-in trainer (runtime/standin.py): no Megatron, no experts
    args = megatron_training.get_args()
    if not getattr(args, "num_experts", None):
        return None
    tp = args.tensor_model_parallel_size
    _LOAD = MoeLoad(ctx, layers=args.num_layers + (args.mtp_num_layers or 0), experts=args.num_experts,
                    topk=args.moe_router_topk, log_interval=log_interval,
                    duplicates=tp if tp > 1 and not args.sequence_parallel else 1)
    _patch_router()
    _patch_tracker()
    return _LOAD


def _patch_router() -> None:
    import torch
    from megatron.core.transformer.moe import router

    if getattr(router.TopKRouter.forward, "_megalaunch_moe_load", False):
        return
    forward, dropping = router.TopKRouter.forward, router.apply_router_token_dropping

    @functools.wraps(forward)
    def counted_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _DROPPED.clear()
        probs, routing_map = forward(self, *args, **kwargs)
        if _LOAD is not None and self.training and torch.is_grad_enabled():
            _LOAD.routed(self.layer_number, routing_map, self.topk)
        return probs, routing_map

    @functools.wraps(dropping)
    def counted_dropping(probs: Any, routing_map: Any, *args: Any, **kwargs: Any) -> Any:
        kept_probs, kept_map = dropping(probs, routing_map, *args, **kwargs)
        _DROPPED[:] = [(routing_map.sum(0), (routing_map & kept_map).sum())]
        return kept_probs, kept_map

    counted_forward._megalaunch_moe_load = True  # type: ignore[attr-defined]
    router.TopKRouter.forward = counted_forward
    router.apply_router_token_dropping = counted_dropping


def _patch_tracker() -> None:
    from megatron.core.transformer.moe import moe_logging

    cls = moe_logging.MoEMetricsTracker
    aggregate = getattr(cls, "_aggregate", None)
    if aggregate is None or getattr(aggregate, "_megalaunch_moe_load", False):
        return  # another Megatron: the counts still come, the aux losses not

    @functools.wraps(aggregate)
    def tracked(self: Any, loss_scale: float, num_moe_layers: int, metric_names: list[str], *args: Any,
                **kwargs: Any) -> Any:
        if _LOAD is not None:
            _LOAD.tracked({n: self.metrics[n].values for n in metric_names if n in self.metrics}, loss_scale)
        return aggregate(self, loss_scale, num_moe_layers, metric_names, *args, **kwargs)

    tracked._megalaunch_moe_load = True  # type: ignore[attr-defined]
    cls._aggregate = tracked
