"""Llama-shaped random-weight GGUF models at real sizes for the serving benchmarks (issue 28): written as F16 with the
`gguf` package, then quantized by llama.cpp's own `llama-quantize` (the files users download are made this way).

    benchmarks/setup_peers.sh                  # once: builds llama-quantize next to llama-server
    .venv/bin/python benchmarks/make_models.py [--shapes 1.7b,7b] [--types Q4_0,Q4_K_M] [--out-dir DIR]

Files go to DIR (default ~/.cache/pdserve-bench, never the repo): llama-<shape>-random.<TYPE>.gguf. Idempotent:
a file already there is kept; the F16 file is made again only when a quantized one is missing. F16 files larger than
--delete-f16-above GB are deleted after quantizing (the 7B one is ~13.5 GB), since they can be recreated.

Shapes: `1.7b` has SmolLM2-1.7B's dimensions (tied embeddings), `7b` Llama-2-7B's (untied) with a 49152 vocab; `moe`
is a Qwen3-MoE (llama.cpp's `qwen3moe`) with Qwen3-30B-A3B's layers (hidden 2048, 32 query / 4 KV heads of 128, 128
experts of 768, 8 per token) but 6 of its 48 layers and a 49152 vocab: a decode step does per layer what the
30B-A3B's does (qwen3moe-moe-random.<TYPE>.gguf). All use the tokenizer (tokenizer.ggml.* keys and chat template)
copied from the default model's GGUF, so pdserve and llama-server tokenize them alike. Weights are N(0, 0.02²)
(norms 1), so activations stay finite: values come from one seeded pool of normal samples, each tensor a window at
its own random offset, so a 7B file is written at disk speed (a fresh normal draw per weight takes ~10 min on 2 busy
cores). Tensors are streamed one at a time: RAM stays under ~1 GB. These files measure speed only; their text is
noise.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

DEFAULT_OUT = Path(os.environ.get("PDSERVE_BENCH_MODELS", Path.home() / ".cache" / "pdserve-bench"))
DEFAULT_PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "pdserve-peers"))
POOL_SIZE = 1 << 26  # 64 Mi normal samples (128 MiB as f16)
STD = 0.02


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's dimensions (Hugging Face names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    head_dim_: int = 0  # 0: hidden_size / num_attention_heads
    num_experts: int = 0  # > 0: a qwen3moe model, every layer sparse
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden_size // self.num_attention_heads

    @property
    def arch(self) -> str:
        return "qwen3moe" if self.num_experts else "llama"


SHAPES = {
    # SmolLM2-1.7B
    "1.7b": Shape(2048, 24, 32, 32, 8192, 49152, True, 130000.0, 8192),
    # Llama-2-7B, with the default model's 49152-token vocab
    "7b": Shape(4096, 32, 32, 32, 11008, 49152, False, 10000.0, 4096),
    # Qwen3-30B-A3B's layers, 6 of 48
    "moe": Shape(2048, 6, 32, 4, 6144, 49152, True, 1000000.0, 40960, 1e-6, head_dim_=128, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768),
}


def model_path(out_dir: Path, shape: str, qtype: str) -> Path:
    return out_dir / f"{SHAPES[shape].arch}-{shape}-random.{qtype}.gguf"


def tensor_shapes(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape (rows = output features)) in llama.cpp's order; 1-D tensors are the norms."""
    h, q, kv, ff = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim, \
        s.intermediate_size
    yield "token_embd.weight", (s.vocab_size, h)
    for i in range(s.num_hidden_layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", (h,)
        yield f"{b}.attn_q.weight", (q, h)
        yield f"{b}.attn_k.weight", (kv, h)
        yield f"{b}.attn_v.weight", (kv, h)
        yield f"{b}.attn_output.weight", (h, q)
        yield f"{b}.ffn_norm.weight", (h,)
        if s.num_experts:  # q/k norms; the router and the experts as 3-D tensors [E, rows, cols]
            e, moe_ff = s.num_experts, s.moe_intermediate_size
            yield f"{b}.attn_q_norm.weight", (s.head_dim,)
            yield f"{b}.attn_k_norm.weight", (s.head_dim,)
            yield f"{b}.ffn_gate_inp.weight", (e, h)
            yield f"{b}.ffn_gate_exps.weight", (e, moe_ff, h)
            yield f"{b}.ffn_up_exps.weight", (e, moe_ff, h)
            yield f"{b}.ffn_down_exps.weight", (e, h, moe_ff)
            continue
        yield f"{b}.ffn_gate.weight", (ff, h)
        yield f"{b}.ffn_up.weight", (ff, h)
        yield f"{b}.ffn_down.weight", (h, ff)
    yield "output_norm.weight", (h,)
    if not s.tie_word_embeddings:
        yield "output.weight", (s.vocab_size, h)


@functools.cache  # parsing the vocabulary and merges takes seconds; every shape written copies the same fields
def tokenizer_fields(src: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The tokenizer.* key-value pairs of a GGUF file, typed as stored (read-only: one list per file)."""
    reader = gguf.GGUFReader(src)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        out.append((key, field.contents(), vtype, sub))
    return out


def add_metadata(w: gguf.GGUFWriter, name: str, s: Shape, tokenizer_src: Path) -> None:
    w.add_name(f"{s.arch}-{name}-random")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_block_count(s.num_hidden_layers)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_attention_heads)
    w.add_head_count_kv(s.num_key_value_heads)
    w.add_rope_dimension_count(s.head_dim)
    if s.num_experts:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_expert_count(s.num_experts)
        w.add_expert_used_count(s.num_experts_per_tok)
        w.add_expert_feed_forward_length(s.moe_intermediate_size)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_vocab_size(s.vocab_size)
    for key, val, vtype, sub in tokenizer_fields(tokenizer_src):
        w.add_key_value(key, val, vtype, sub)


def write_f16(path: Path, name: str, s: Shape, tokenizer_src: Path, seed: int, pool_size: int = POOL_SIZE) -> None:
    """Stream a random-weight F16 GGUF to `path` (via a temporary name, so a killed run leaves no partial file)."""
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(pool_size, dtype=np.float32) * STD).astype(np.float16)
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(tmp, s.arch)
    add_metadata(w, name, s, tokenizer_src)
    shapes = list(tensor_shapes(s))
    for tname, shp in shapes:
        dtype = np.float32 if len(shp) == 1 else np.float16
        w.add_tensor_info(tname, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shp in shapes:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
            continue
        n = int(np.prod(shp))
        data = np.empty(n, dtype=np.float16)
        done = 0
        while done < n:  # windows at random offsets; a tensor larger than the pool takes several
            take = min(n - done, pool_size // 2)
            off = int(rng.integers(0, pool_size - take + 1))
            data[done:done + take] = pool[off:off + take]
            done += take
        w.write_tensor_data(data.reshape(shp))
    w.close()
    tmp.replace(path)


def quantize(binary: Path, src: Path, dst: Path, qtype: str, threads: int) -> None:
    tmp = dst.with_suffix(".part")
    cmd = ["nice", str(binary), str(src), str(tmp), qtype, str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    tmp.replace(dst)


def make_shape(args: argparse.Namespace, name: str, tokenizer_src: Path) -> None:
    s = SHAPES[name]
    f16 = model_path(args.out_dir, name, "F16")
    missing = [t for t in args.types if not model_path(args.out_dir, name, t).exists()]
    if not f16.exists() and (missing or "F16" in args.types):
        t0 = time.monotonic()
        print(f"{name}: writing {f16} ...", file=sys.stderr, flush=True)
        write_f16(f16, name, s, tokenizer_src, args.seed)
        print(f"  {f16.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    for qtype in missing:
        if qtype == "F16":
            continue
        dst = model_path(args.out_dir, name, qtype)
        t0 = time.monotonic()
        print(f"{name}: llama-quantize {qtype} -> {dst} ...", file=sys.stderr, flush=True)
        quantize(args.llama_quantize, f16, dst, qtype, args.threads)
        print(f"  {dst.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if f16.exists() and "F16" not in args.types and f16.stat().st_size > args.delete_f16_above * 1e9:
        print(f"{name}: deleting {f16} ({f16.stat().st_size / 1e9:.1f} GB; rerun to recreate)", file=sys.stderr)
        f16.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.7b,7b", help=f"comma-separated, from {','.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama-quantize types (F16: keep the F16 file)")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--llama-quantize", type=Path, default=DEFAULT_PEERS / "llama-quantize")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delete-f16-above", type=float, default=8.0, help="GB; F16 files above it are deleted")
    args = ap.parse_args(argv)
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"unknown shape(s) {bad}; choose from {','.join(SHAPES)}")
    if any(t != "F16" for t in args.types) and not os.access(args.llama_quantize, os.X_OK):
        ap.error(f"{args.llama_quantize} not found: build it with benchmarks/setup_peers.sh")
    from pdserve.model.loader import resolve_model_path

    tokenizer_src = Path(resolve_model_path(None))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in shapes:
        s = SHAPES[name]
        need = sum(int(np.prod(shp)) * 2 for _, shp in tensor_shapes(s)) * 1.5  # F16 + its quantized copies
        free = shutil.disk_usage(args.out_dir).free
        if not model_path(args.out_dir, name, "F16").exists() and free < need:
            print(f"{name}: skipped, {free / 1e9:.1f} GB free in {args.out_dir}, needs ~{need / 1e9:.1f} GB",
                  file=sys.stderr)
            continue
        make_shape(args, name, tokenizer_src)
    for p in sorted(args.out_dir.glob("*-random.*.gguf")):
        print(f"{p}  {p.stat().st_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
