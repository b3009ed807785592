"""Conversion throughput and memory, next to the disk's own speed, measured in the same run.

    python bench/convert.py [--size-gb 4] [--hidden 2048] [--vocab 128256] [--workdir DIR]
                            [--threads N] [--max-inflight-gb G] [--crc32] [--fsync]

Generates a random Llama-shaped bf16 model of about --size-gb in Hugging Face format (streamed to
disk, cached in --workdir), measures the disk's sequential read speed on a file of the same size with
the page cache dropped (posix_fadvise), then converts hf -> mcore -> hf, each in a fresh process with
its inputs dropped from the page cache, and reports:
  - throughput (GB of weights per second of conversion) and its share of the disk's read speed
    (target >= 50 %; conversion reads and writes every byte once);
  - peak RSS of the conversion process: absolute and above the baseline after imports (torch,
    megatron), against the largest tensor group (the embedding, or one layer; target <= 2x);
  - that the round trip is bit-exact (streamed comparison, tensor by tensor).
Exit status 1 when a target is missed."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# bench/ is not a package: keep its scripts from shadowing standard-library modules.
sys.path[:] = [str(SRC), str(SRC.parent)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

GB = 1e9

_WORKER = r"""
import json, os, sys, threading, time
from pathlib import Path
import psutil, torch
import megatron.core.dist_checkpointing  # noqa: F401  (imports count in the baseline, not the peak)
from megalaunch.conversion import hf_to_mcore, mcore_to_hf
direction, src, dst, fsync = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
options = json.loads(sys.argv[5])
for f in src.rglob("*"):
    if f.is_file():
        fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
proc = psutil.Process()
baseline = proc.memory_info().rss
peak = [baseline]
done = threading.Event()
def sample():
    while not done.wait(0.002):
        peak[0] = max(peak[0], proc.memory_info().rss)
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
if direction == "hf-to-mcore":
    r = hf_to_mcore(src, dst, progress=False, fsync=fsync, **options)
else:
    r = mcore_to_hf(src, dst, progress=False, fsync=fsync)
wall = time.perf_counter() - t0
done.set()
# VmHWM: the peak RSS of this process image (ru_maxrss would include the parent's, inherited at fork)
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": r.seconds, "wall": wall, "bytes": r.bytes, "tensors": r.tensors,
                  "largest_group": r.largest_group_bytes, "baseline_rss": baseline,
                  "peak_rss": max(hwm, peak[0]), "threads": r.threads, "max_inflight": r.max_inflight_bytes,
                  "peak_inflight": r.peak_inflight_bytes}))
"""


def model_shape(size_gb: float, hidden: int, vocab: int) -> tuple[int, int]:
    """(layers, ffn) for a bf16 Llama of about size_gb: GQA with 8 KV groups of 128-wide heads."""
    heads = max(hidden // 128, 1)
    groups = min(8, heads)
    ffn = 4 * hidden
    head_dim = hidden // heads
    layer = 2 * (hidden * (heads + 2 * groups) * head_dim + hidden * hidden + 3 * hidden * ffn + 2 * hidden)
    embeddings = 2 * 2 * vocab * hidden
    layers = max(1, round((size_gb * GB - embeddings) / layer))
    return layers, ffn


def generate(path: Path, size_gb: float, hidden: int, vocab: int) -> dict[str, int]:
    import torch
    from tests.support.hf_models import hf_config  # noqa: F401  (needs transformers: fail early)

    from megalaunch.config.schema import ModelConfig
    from megalaunch.conversion.checkpoint_io.safetensors_io import SafetensorsWriter
    from megalaunch.conversion.families import hf_config_from_model

    layers, ffn = model_shape(size_gb, hidden, vocab)
    heads = max(hidden // 128, 1)
    shape = {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "groups": min(8, heads), "vocab": vocab}
    marker = path / "bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        return shape
    shutil.rmtree(path, ignore_errors=True)
    model = ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                        num_query_groups=min(8, heads), rotary_base=500000, max_position_embeddings=8192,
                        seq_length=8192)
    cfg = hf_config_from_model(model, family="llama", vocab_size=vocab, dtype="bfloat16")
    d, kv = hidden // heads, min(8, heads) * (hidden // heads)
    plan = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        plan += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.self_attn.q_proj.weight", (heads * d, hidden)),
                 (f"{p}.self_attn.k_proj.weight", (kv, hidden)), (f"{p}.self_attn.v_proj.weight", (kv, hidden)),
                 (f"{p}.self_attn.o_proj.weight", (hidden, heads * d)),
                 (f"{p}.post_attention_layernorm.weight", (hidden,)), (f"{p}.mlp.gate_proj.weight", (ffn, hidden)),
                 (f"{p}.mlp.up_proj.weight", (ffn, hidden)), (f"{p}.mlp.down_proj.weight", (hidden, ffn))]
    plan += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    writer = SafetensorsWriter(path, [(n, "BF16", s) for n, s in plan])
    g = torch.Generator().manual_seed(0)
    for name, s in plan:
        writer.write(name, torch.randn(s, generator=g, dtype=torch.float32).mul_(0.02).to(torch.bfloat16))
    writer.close()
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    marker.write_text(json.dumps(shape))
    return shape


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def disk_speed(workdir: Path, nbytes: int) -> tuple[float, float]:
    """(sequential read GB/s, sequential write GB/s incl. fsync) on a file of nbytes."""
    probe = workdir / "disk-probe.bin"
    block = os.urandom(16 * 2**20)
    t0 = time.perf_counter()
    with open(probe, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(block)
        os.fsync(f.fileno())
    write = written / (time.perf_counter() - t0) / GB
    drop_cache(probe)
    buf = bytearray(16 * 2**20)
    t0 = time.perf_counter()
    with open(probe, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read = written / (time.perf_counter() - t0) / GB
    probe.unlink()
    return read, write


def run_worker(direction: str, src: Path, dst: Path, options: dict[str, object], fsync: bool) -> dict[str, float]:
    shutil.rmtree(dst, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _WORKER, direction, str(src), str(dst), str(int(fsync)),
                          json.dumps(options)],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{direction} failed:\n{res.stderr[-3000:]}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def bit_exact(a: Path, b: Path) -> bool:
    import torch

    from megalaunch.conversion.checkpoint_io.safetensors_io import SafetensorsReader

    with SafetensorsReader(a) as ra, SafetensorsReader(b) as rb:
        if ra.tensors.keys() != rb.tensors.keys():
            return False
        return all(torch.equal(ra.read(n), rb.read(n)) for n in ra.tensors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="model size in GB (bf16)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/megalaunch-bench-convert"))
    ap.add_argument("--threads", type=int, default=None, help="hf-to-mcore writer threads (default: megalaunch's)")
    ap.add_argument("--max-inflight-gb", type=float, default=None,
                    help="hf-to-mcore budget for tensors in flight (default: 1.5x the largest tensor group)")
    ap.add_argument("--crc32", action="store_true", help="hf-to-mcore: write zip CRC32s (megalaunch's --crc32)")
    ap.add_argument("--fsync", action="store_true", help="convert with --fsync (bounded by the write speed)")
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-exact round-trip comparison")
    args = ap.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    hf, mcore, back = args.workdir / "hf", args.workdir / "mcore", args.workdir / "hf-back"
    t0 = time.perf_counter()
    shape = generate(hf, args.size_gb, args.hidden, args.vocab)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    print(f"model: {shape} = {size / GB:.2f} GB bf16 ({time.perf_counter() - t0:.0f} s to generate or reuse)")
    read, write = disk_speed(args.workdir, size)
    print(f"disk ({args.workdir}): sequential read {read:.2f} GB/s, write+fsync {write:.2f} GB/s "
          f"({size / GB:.2f} GB, page cache dropped)")
    ok = True
    results = {}
    options: dict[str, object] = {"crc32": args.crc32}
    if args.threads is not None:
        options["threads"] = args.threads
    if args.max_inflight_gb is not None:
        options["max_inflight_bytes"] = int(args.max_inflight_gb * GB)
    for direction, src, dst in (("hf-to-mcore", hf, mcore), ("mcore-to-hf", mcore, back)):
        r = run_worker(direction, src, dst, options if direction == "hf-to-mcore" else {}, args.fsync)
        results[direction] = r
        gbps = r["bytes"] / r["seconds"] / GB
        added = r["peak_rss"] - r["baseline_rss"]
        speed_ok = gbps >= 0.5 * read
        mem_ok = added <= 2 * r["largest_group"]
        ok &= speed_ok and mem_ok
        print(f"{direction}: {r['tensors']} tensors, {r['bytes'] / GB:.2f} GB in {r['seconds']:.1f} s = {gbps:.2f} GB/s "
              f"= {100 * gbps / read:.0f} % of disk read [{'ok' if speed_ok else 'MISSED'} >= 50 %]; "
              f"peak RSS {r['peak_rss'] / GB:.2f} GB = baseline {r['baseline_rss'] / GB:.2f} GB + {added / GB:.2f} GB "
              f"vs largest tensor group {r['largest_group'] / GB:.2f} GB "
              f"[{'ok' if mem_ok else 'MISSED'} <= 2x]; process wall {r['wall']:.1f} s")
        if direction == "hf-to-mcore":
            print(f"  {r['threads']} threads, in-flight budget {r['max_inflight'] / GB:.2f} GB "
                  f"({r['max_inflight'] / r['largest_group']:.2f}x the largest group), "
                  f"peak in flight {r['peak_inflight'] / GB:.2f} GB")
    if not args.no_verify:
        exact = bit_exact(hf, back)
        ok &= exact
        print(f"round trip bit-exact: {exact}")
    print(json.dumps({"disk_read_gbps": read, "disk_write_gbps": write, "size_bytes": size, **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
