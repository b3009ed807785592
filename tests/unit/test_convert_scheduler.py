"""hf-to-mcore's bounded concurrency: a byte budget for the tensors in flight, not a thread count."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megalaunch.conversion.checkpoint_io.scheduler import BufferPool, run_in_order


class Recorder:
    """Instruments jobs: the bytes and the number of jobs running at each moment."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running_bytes = 0
        self.running = 0
        self.holding = 0  # running jobs that hold bytes
        self.max_bytes = 0
        self.max_running = 0
        self.started: list[int] = []
        self.alone: dict[int, bool] = {}
        self.allocated: list[int] = []

    def allocate(self, n: int) -> bytearray:
        with self.lock:
            self.allocated.append(n)
        return bytearray(n)

    def work(self, job: tuple[int, int], buffer: Any) -> int:
        ticket, size = job
        assert (buffer is None) == (size == 0) and (buffer is None or len(buffer) >= size)
        with self.lock:
            self.running_bytes += size
            self.running += 1
            self.holding += size > 0
            self.max_bytes = max(self.max_bytes, self.running_bytes)
            self.max_running = max(self.max_running, self.running)
            self.started.append(ticket)
            self.alone[ticket] = self.holding == (size > 0)  # no other job holding bytes
        time.sleep(0.002 + size / 1e6)  # bigger tensors take longer
        with self.lock:
            self.running_bytes -= size
            self.running -= 1
            self.holding -= size > 0
        return ticket


def model_like_jobs(layers: int = 6) -> list[tuple[int, int]]:
    """Sizes like a Llama: a big embedding, per layer norm/qkv/proj/norm/fc1/fc2, norm, output layer."""
    sizes = [5000]
    for _ in range(layers):
        sizes += [2, 300, 200, 2, 1600, 800]
    sizes += [2, 5000]
    return list(enumerate(sizes))


@pytest.mark.parametrize("threads", [1, 2, 4, 8])
def test_bytes_in_flight_never_exceed_the_budget(threads: int) -> None:
    jobs = model_like_jobs()
    budget = 7500  # 1.5x the largest tensor
    rec = Recorder()
    pool = BufferPool(budget, allocate=rec.allocate)
    assert run_in_order(jobs, lambda j: j[1], rec.work, threads=threads, pool=pool) == [t for t, _ in jobs]
    assert rec.max_bytes <= budget and pool.peak_leased <= budget
    assert pool.peak_held <= budget  # leased + cached buffers: what the pool can keep resident
    assert rec.max_running <= threads
    assert rec.started == sorted(rec.started)  # admitted in order: the big ones are not starved
    if threads > 1:
        assert rec.max_running > 1  # the budget still lets small tensors overlap
    # layers repeat their sizes: buffers are reused, not allocated for every tensor
    assert len(rec.allocated) < (len(jobs) // 2 if threads <= 4 else len(jobs))


def test_a_tensor_larger_than_the_budget_runs_alone() -> None:
    jobs = [(0, 100), (1, 100), (2, 5000), (3, 100), (4, 100), (5, 0), (6, 4000)]
    rec = Recorder()
    pool = BufferPool(1000, allocate=rec.allocate)
    run_in_order(jobs, lambda j: j[1], rec.work, threads=4, pool=pool)
    assert rec.alone[2] and rec.alone[6]
    assert pool.oversized == 2
    assert rec.max_running > 1  # the small ones did overlap
    pool.clear()
    assert pool.peak_held <= 5000


def test_random_sizes_respect_the_budget() -> None:
    rng = random.Random(0)
    jobs = [(n, rng.choice([0, 1, 10, 100, 400, 900, 2000])) for n in range(200)]
    rec = Recorder()
    pool = BufferPool(1000, allocate=rec.allocate)
    run_in_order(jobs, lambda j: j[1], rec.work, threads=6, pool=pool)
    big = {t for t, s in jobs if s > 1000}
    assert all(rec.alone[t] for t in big)
    # while no oversized job runs, the bytes stay within the budget; peak_leased counts all of them
    assert pool.peak_leased <= 2000
    assert sorted(rec.started) == rec.started


def test_an_error_stops_every_worker_and_is_raised() -> None:
    calls: list[int] = []

    def work(job: tuple[int, int], buffer: Any) -> int:
        calls.append(job[0])
        if job[0] == 5:
            raise ValueError("tensor 5 is broken")
        time.sleep(0.001)
        return job[0]

    jobs = [(n, 100) for n in range(100)]
    with pytest.raises(ValueError, match="tensor 5"):
        run_in_order(jobs, lambda j: j[1], work, threads=4, pool=BufferPool(250, allocate=bytearray))
    assert len(calls) < 20  # the others stopped soon after


# ------------------------------------------------------------------------------ end to end


def _tiny_llama(path: Path, *, layers: int = 3, hidden: int = 64, vocab: int = 1000, dtype: str = "BF16") -> None:
    """A Llama-shaped safetensors model (no transformers needed), large embedding."""
    import json

    import torch

    from megalaunch.config.schema import ModelConfig
    from megalaunch.conversion.checkpoint_io.safetensors_io import SafetensorsWriter, torch_dtype
    from megalaunch.conversion.families import hf_config_from_model

    heads, groups, ffn = 4, 2, 128
    d = hidden // heads
    plan = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        plan += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
                 (f"{p}.self_attn.k_proj.weight", (groups * d, hidden)),
                 (f"{p}.self_attn.v_proj.weight", (groups * d, hidden)),
                 (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
                 (f"{p}.post_attention_layernorm.weight", (hidden,)), (f"{p}.mlp.gate_proj.weight", (ffn, hidden)),
                 (f"{p}.mlp.up_proj.weight", (ffn, hidden)), (f"{p}.mlp.down_proj.weight", (hidden, ffn))]
    plan += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    writer = SafetensorsWriter(path, [(n, dtype, s) for n, s in plan])
    g = torch.Generator().manual_seed(0)
    for name, s in plan:
        writer.write(name, torch.randn(s, generator=g).to(torch_dtype(dtype)))
    writer.close()
    model = ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                        num_query_groups=groups, max_position_embeddings=128, seq_length=128)
    cfg = hf_config_from_model(model, family="llama", vocab_size=vocab, dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.megatron
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_hf_to_mcore_keeps_its_budget_and_stays_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      dtype: str | None) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megalaunch.conversion import hf_to_mcore, mcore_to_hf, to_mcore
    from megalaunch.conversion.checkpoint_io import scheduler
    from megalaunch.conversion.checkpoint_io.safetensors_io import SafetensorsReader

    _tiny_llama(tmp_path / "hf")
    monkeypatch.setattr(to_mcore, "CAST_CHUNK_BYTES", 4096)  # a dtype change reads in several chunks
    leases: list[tuple[int, int]] = []
    original = scheduler.BufferPool.lease

    def lease(self: scheduler.BufferPool, ticket: int, nbytes: int) -> Any:
        buffer = original(self, ticket, nbytes)
        leases.append((self._leased, self.limit))
        return buffer

    monkeypatch.setattr(scheduler.BufferPool, "lease", lease)
    budget = 200_000  # embedding: 128 KB bf16 (256 KB as float32: runs alone)
    report = hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", threads=4, max_inflight_bytes=budget, dtype=dtype,
                         progress=False)
    assert report.max_inflight_bytes == budget and report.threads == 4
    oversized = report.largest_group_bytes > budget
    assert all(leased <= limit for leased, limit in leases) or oversized
    # an oversized tensor runs alone, with its scratch for the dtype change (one 4 KB chunk)
    assert report.peak_inflight_bytes <= (report.largest_group_bytes + 64 + 4096 if oversized else budget)
    assert (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").read_text() == "release\n"
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    with SafetensorsReader(tmp_path / "hf") as a, SafetensorsReader(tmp_path / "back") as b:
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            want = a.read(name) if dtype is None else a.read(name).to(getattr(torch, dtype))
            assert torch.equal(b.read(name), want), name


@pytest.mark.megatron
def test_default_budget_is_a_multiple_of_the_largest_group(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megalaunch.conversion import converter, hf_to_mcore

    _tiny_llama(tmp_path / "hf")
    report = hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    assert report.threads == converter.DEFAULT_THREADS
    assert report.max_inflight_bytes == int(converter.INFLIGHT_FACTOR * report.largest_group_bytes)
    assert report.peak_inflight_bytes <= report.max_inflight_bytes
