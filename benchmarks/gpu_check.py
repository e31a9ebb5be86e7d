"""The GPU check: greedy equality with transformers on the same weights, decode step time and MBU, throughput at
several batch sizes and prefill MFU, on `--device cuda` (or `cpu` with `--quick`: the smoke test CI runs).

    PYTHONPATH=. python benchmarks/gpu_check.py [--model PATH] [--device cuda] [--quick] [--out table.md]

Sections (each a row group of the markdown table printed at the end, for BENCHMARKS.md):
  * equality: greedy tokens of pdserve (float32, the torch path: flex attention and decode graphs on cuda) against
    transformers' generate on the same weights, for English, CJK and a long prompt; the model is `--model` (the
    default model's GGUF, dequantized) when given, else a random Llama with SmolLM2-135M's shapes;
  * decode: batch-1 step time and MBU (bytes the step must read / time / the device's bandwidth) of `--model` and of
    random-weight Llamas of 1B and 8B shapes (bf16; no download needed), at a 512-token context;
  * throughput: output tokens/s at batch 1 / 32 / 128 (128-token prompts, 128 new tokens, ignore_eos);
  * prefill: one 4096-token prompt as one step (max_num_batched_tokens 4096): step time and MFU.
Peaks: the preset of the GPU's name (H200: 989 TFLOP/s bf16 dense, 4.8 TB/s), or `--peaks FLOPS,BYTES_PER_S`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve import SamplingParams
from pdserve.config import EngineConfig, ModelArchConfig
from pdserve.engine.engine import LLMEngine, StepStats
from pdserve.model.loader import LoadedModel, load_model
from pdserve.roofline import DeviceSpec, resolve_device_peaks

# Hugging Face config shapes (no weights): SmolLM2-135M, Llama-3.2-1B, Llama-3-8B
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                               rope_theta=100000.0),
    "llama-1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b-shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0),
}


@dataclass
class Table:
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append(tuple(str(c) for c in cells))
        print(" | ".join(self.rows[-1]), flush=True)

    def markdown(self) -> str:
        head = "| section | model | condition | result | roofline |\n|---|---|---|---|---|\n"
        return head + "\n".join("| " + " | ".join(r) + " |" for r in self.rows) + "\n"


def hf_config(shape: str, max_pos: int) -> dict[str, Any]:
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
               max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2)
    return cfg


def random_model(shape: str, dtype: torch.dtype, max_pos: int = 8192, seed: int = 0) -> LoadedModel:
    """A Llama of the named shape with random weights (std 0.02; norms 1), Hugging Face names, on the host."""
    cfg = hf_config(shape, max_pos)
    arch = ModelArchConfig.from_hf_config(cfg)
    h, inter, kv = arch.hidden_size, arch.intermediate_size, arch.num_key_value_heads * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    gen_dev = "cuda" if torch.cuda.is_available() else "cpu"  # 8B normals on one CPU thread take minutes
    g = torch.Generator(gen_dev).manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=gen_dev).normal_(0, 0.02, generator=g).cpu()

    sd: dict[str, Any] = {"model.embed_tokens.weight": w(arch.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not arch.tie_word_embeddings:
        sd["lm_head.weight"] = w(arch.vocab_size, h)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
               p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
               p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
               p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h),
               p + "post_attention_layernorm.weight": torch.ones(h)}
    return LoadedModel(arch=arch, hf_config=cfg, state_dict=sd, source=f"<random {shape}>")


class _NoTokenizer:
    """Token-id prompts only (random models have no tokenizer)."""

    eos_token_id = None

    def decode(self, ids: list[int], **kw: Any) -> str:
        return ""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["" for _ in ids]


def make_engine(loaded: LoadedModel, device: str, dtype: str, tokenizer: Any = None, **options: Any) -> LLMEngine:
    gc.collect()  # the previous section's engine and its KV cache go first
    if device == "cuda":
        torch.cuda.empty_cache()
    options.setdefault("max_model_len", 8192)
    cfg = EngineConfig(device=device, dtype=dtype, device_peaks="off", max_step_ms=0, **options)
    return LLMEngine(cfg, model=loaded, tokenizer=tokenizer or _NoTokenizer())


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]],
                                                                                     list[StepStats], float]:
    """(output token ids per prompt, step stats, wall seconds) of serving the prompts to completion."""
    reqs = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    stats = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        stats.append(engine.step().stats)
    wall = time.perf_counter() - t0
    assert engine.block_manager.is_at_baseline(), "KV blocks leaked"
    return [list(r.output_token_ids) for r in reqs], stats, wall


def roofline(stats: list[StepStats], peaks: DeviceSpec | None, what: str) -> tuple[float, str]:
    """Median model time of the steps and MBU (decode) or MFU (prefill) against the peaks."""
    t = statistics.median(s.model_time for s in stats)
    if peaks is None:
        return t, "no peaks"
    if what == "mbu":
        return t, f"MBU {statistics.median(s.bytes / s.model_time for s in stats) / peaks.mem_bandwidth:.2f}"
    return t, f"MFU {statistics.median(s.flops / s.model_time for s in stats) / peaks.peak_flops:.2f}"


def check_equality(table: Table, loaded: LoadedModel, name: str, device: str, prompts: list[list[int]],
                   new: int) -> bool:
    """pdserve float32 on `device` vs transformers float32 on `device`, same weights, greedy."""
    import transformers

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**loaded.hf_config)).eval()
    sd = {k: v.float() for k, v in loaded.state_dict.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    hf.to(device)
    engine = make_engine(loaded, device, "float32", max_num_batched_tokens=512, num_kv_blocks=512)
    ours, _, _ = run(engine, prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    ok = 0
    for p, out in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([p], device=device)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        ok += out == ref
    table.add("equality", name, f"{len(prompts)} prompts x {new} greedy tokens, fp32, {device}",
              f"{ok}/{len(prompts)} identical", "–")
    return ok == len(prompts)


def bench_decode(table: Table, loaded: LoadedModel, name: str, device: str, dtype: str, peaks: DeviceSpec | None,
                 context: int, steps: int) -> None:
    engine = make_engine(loaded, device, dtype, max_num_batched_tokens=max(context, 512), num_kv_blocks=
                         (context + steps) // 16 + 4, max_num_seqs=1)
    prompt = [(i * 37) % (loaded.arch.vocab_size - 3) + 3 for i in range(context)]
    _, stats, _ = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    decodes = [s for s in stats if s.kind.value == "decode"][3:]  # the first replays capture their graph
    t, rl = roofline(decodes, peaks, "mbu")
    table.add("decode batch 1", name, f"{dtype}, context {context}, {len(decodes)} steps", f"{t * 1e3:.3f} ms/step",
              rl)


def bench_throughput(table: Table, loaded: LoadedModel, name: str, device: str, dtype: str, batch: int,
                     prompt_len: int, new: int) -> None:
    blocks = batch * ((prompt_len + new) // 16 + 2)
    engine = make_engine(loaded, device, dtype, max_num_seqs=batch, num_kv_blocks=blocks,
                         max_num_batched_tokens=max(512, prompt_len * min(batch, 16)))
    prompts = [[(i * 31 + j * 7) % (loaded.arch.vocab_size - 3) + 3 for j in range(prompt_len)] for i in range(batch)]
    run(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up, graphs
    outs, _, wall = run(engine, prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    n = sum(len(o) for o in outs)
    table.add("throughput", name, f"{dtype}, batch {batch}, prompt {prompt_len}, {new} new", f"{n / wall:.0f} "
              "output tok/s", "–")


def bench_prefill(table: Table, loaded: LoadedModel, name: str, device: str, dtype: str, peaks: DeviceSpec | None,
                  tokens: int, repeats: int) -> None:
    engine = make_engine(loaded, device, dtype, max_num_batched_tokens=tokens, num_kv_blocks=tokens // 16 + 8,
                         max_num_seqs=1, enable_prefix_caching=False)
    stats = []
    for r in range(repeats + 1):
        prompt = [(i * 13 + r) % (loaded.arch.vocab_size - 3) + 3 for i in range(tokens)]
        _, st, _ = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        stats += [s for s in st if s.kind.value == "prefill"][:1] if r else []  # the first compiles
    t, rl = roofline(stats, peaks, "mfu")
    table.add("prefill", name, f"{dtype}, {tokens} tokens in one step", f"{t * 1e3:.1f} ms", rl)


def model_tokenizer(loaded: LoadedModel) -> Any:
    """The model's tokenizer: the saved copy in $PDSERVE_TEST_TOKENIZER (a GGUF's needs the `gguf` package to
    convert, which the GPU machine lacks), else the model's own; None when neither loads (token-id prompts)."""
    saved = os.environ.get("PDSERVE_TEST_TOKENIZER")
    try:
        if saved:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(saved)
        return loaded.tokenizer()
    except Exception as exc:  # noqa: BLE001 - the check goes on with token-id prompts
        print(f"no tokenizer ({type(exc).__name__}: {exc}); token-id prompts only", flush=True)
        return None


def main(argv: list[str] | None = None) -> tuple[Table, bool]:
    """Runs every section; (the table, whether greedy equality held)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="the default model's GGUF (or any model path) for the equality "
                    "and decode rows; without it a random model of SmolLM2-135M's shapes stands in")
    ap.add_argument("--peaks", default="auto", help="`auto` (the GPU's preset), a preset, or FLOPS,BYTES_PER_S")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few steps: the CPU smoke test")
    ap.add_argument("--large", default="llama-1b-shape,llama-8b-shape", help="random-weight shapes to time")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    dev, q = args.device, args.quick
    peaks = resolve_device_peaks(args.peaks, device=dev) if args.peaks != "off" else None
    dtype = "bfloat16" if dev == "cuda" else "float32"
    table = Table()
    print(f"# gpu_check: torch {torch.__version__}, device {dev}"
          f"{' (' + torch.cuda.get_device_name() + ')' if dev == 'cuda' else ''}, peaks {peaks}", flush=True)
    small = "tiny" if q else "smollm2-135m-shape"
    fp32_model = load_model(args.model, dtype=torch.float32) if args.model else random_model(small, torch.float32)
    name = args.model.rsplit("/", 1)[-1] if args.model else small
    eq_prompts = [[1, 2, 3], [(i * 7) % 49000 + 3 for i in range(40)], [(i * 11) % 49000 + 3 for i in range(300)]]
    tok = model_tokenizer(fp32_model) if args.model else None
    if tok is not None:
        eq_prompts[:2] = [tok.encode("Hello, my name is"), tok.encode("你好，世界！请介绍一下杭州的西湖。")]
    ok = check_equality(table, fp32_model, name, dev, eq_prompts, 8 if q else 32)
    models = [(name, fp32_model)] + [(s, random_model(s, torch.bfloat16)) for s in
                                     (["tiny"] if q else [s for s in args.large.split(",") if s])]
    for mname, loaded in models:
        bench_decode(table, loaded, mname, dev, dtype, peaks, 64 if q else 512, 8 if q else 64)
    big_name, big = models[-1]
    if dev == "cuda":  # the KV cache sized from device memory (gpu_memory_utilization 0.9, profiled step)
        engine = make_engine(big, dev, dtype, max_num_batched_tokens=4096, gpu_memory_utilization=0.9)
        kv_gib = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() / 2**30
        table.add("memory plan", big_name, "gpu_memory_utilization 0.9, max_num_batched_tokens 4096",
                  f"{engine.num_blocks} KV blocks ({kv_gib:.1f} GiB)", "–")
        del engine
    for batch in ([1, 4] if q else [1, 32, 128]):
        bench_throughput(table, big, big_name, dev, dtype, batch, 16 if q else 128, 8 if q else 128)
    bench_prefill(table, big, big_name, dev, dtype, peaks, 64 if q else 4096, 1 if q else 3)
    md = table.markdown()
    print("\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    if not ok:
        print("greedy equality FAILED", file=sys.stderr)
    return table, ok


if __name__ == "__main__":
    sys.exit(0 if main()[1] else 1)
