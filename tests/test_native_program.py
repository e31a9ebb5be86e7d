"""The native whole-stack program is the Python definition: recorded from it (model/native_program.py), it computes
bit for bit what the layer modules compute one native op at a time, for every architecture and weight format; it
refuses what it cannot express (the model then runs its Python definition), and holds activations per layer, not
per stack."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_loader import tiny_model, write_gguf

from pdserve import kernels
from pdserve.model.attention import ForwardContext
from pdserve.model.inputs import ScheduledRequest, SchedulerOutput
from pdserve.model.layers.linear import Embedding, Linear
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import LoadedModel, load_gguf
from pdserve.model.native_program import RECORD_TOKENS, ProgramRecorder, ProgramUnsupported, record
from pdserve.model.runner import ModelRunner

from conftest import loaded_from_hf, make_tiny_hf_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels are not built")

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]  # qwen2: q/k/v bias; qwen3: q/k norm per head
# a layer after its input norm (the column slices q, k, v of the qkv output are taken where first used)
LAYER_OPS = {"llama": ["linear", "narrow", "narrow", "rotary", "narrow", "attention", "linear", "add_rms_norm",
                       "gated_mlp"],
             "qwen3": ["linear", "narrow", "head_rms_norm", "narrow", "head_rms_norm", "rotary", "narrow",
                       "attention", "linear", "add_rms_norm", "gated_mlp"]}


def loaded(kind: str, weights: str, tmp_path: Path, **overrides: Any) -> LoadedModel:
    model = tiny_model(kind, seed=5, **overrides)
    if weights == "float":
        return loaded_from_hf(model)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, model, kind, qtype=lambda name, w: Q.Q8_0 if "embed" in name or "lm_head" in name else Q.Q4_1)
    return load_gguf(str(path), keep_quantized=True)


def native_runner(lm: LoadedModel, dtype: torch.dtype = torch.float32) -> ModelRunner:
    return ModelRunner(lm.arch, lm.state_dict, dtype, num_blocks=20, block_size=16, max_model_len=320,
                       kernels="native")


STEPS = [  # two prefills, then a decode beside a chunk with context that crosses x's prompt end (50): prompt rows
    # and generated rows in one step (their linears and attention may differ in arithmetic, never between paths)
    SchedulerOutput([ScheduledRequest("x", list(range(5, 45)), 0, [3, 7, 1], True, num_prompt_tokens=50),
                     ScheduledRequest("y", list(range(9, 20)), 0, [2], True, num_prompt_tokens=11)],
                    num_prefill_tokens=51),
    SchedulerOutput([ScheduledRequest("y", [21], 11, [2], True, num_prompt_tokens=11),
                     ScheduledRequest("x", list(range(45, 60)), 40, [3, 7, 1, 9], True, num_prompt_tokens=50)],
                    num_prefill_tokens=15, num_decodes=1),
]


LONG_STEP = [  # a prompt longer than the gated MLP's row chunk (it runs as two chunks of 150 rows, then one of 4; with
    # I = 8192, as five of 60 rows)
    SchedulerOutput([ScheduledRequest("z", [(7 * i) % 200 + 3 for i in range(300)], 0, list(range(19)), True,
                                      num_prompt_tokens=304)], num_prefill_tokens=300),
    SchedulerOutput([ScheduledRequest("z", [5, 6, 7, 8], 300, list(range(19)), True, num_prompt_tokens=304)],
                    num_prefill_tokens=4)]


def assert_program_equals_definition(runner: ModelRunner, steps: list[SchedulerOutput] = STEPS) -> None:
    """Each step through the program and through the Python definition from the same cache: same bits."""
    model = runner.model
    assert model.program is not None
    for sched in steps:
        inp = runner.prepare(sched)
        kv_program, kv_python = runner.kv_cache.clone(), runner.kv_cache.clone()
        with torch.inference_mode():
            a = model(inp.input_ids, inp.positions, kv_program, inp.meta)
            b = model.hidden_states(inp.input_ids, inp.positions, ForwardContext(kv_python, inp.meta))
        assert torch.equal(a, b) and torch.equal(kv_program, kv_python)
        runner.kv_cache.copy_(kv_program)


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("weights", ["gguf", "float"])
def test_program_equals_the_python_definition(kind: str, weights: str, tmp_path: Path) -> None:
    """GGUF matrices packed as stored (pack_gguf), and float weights packed as f32 (pack_float)."""
    assert_program_equals_definition(native_runner(loaded(kind, weights, tmp_path)))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_program_equals_the_python_definition_with_bf16_prompt_rows(kind: str, tmp_path: Path) -> None:
    """GGUF blocks with dtype bfloat16: prompt rows may take other kernels (AMX tiles) in the linears and the
    attention; the program and the per-layer path give every row the same kind, so the same bits."""
    runner = native_runner(loaded(kind, "gguf", tmp_path), torch.bfloat16)
    assert runner.model.kernels.ops.bf16_prompt_rows
    assert_program_equals_definition(runner)
    assert_program_equals_definition(runner, LONG_STEP)  # the MLP's row chunks keep each row's kind


@pytest.mark.parametrize("weights", ["gguf", "float"])
def test_long_prefill_runs_the_mlp_in_row_chunks_with_the_same_bits(weights: str, tmp_path: Path) -> None:
    """A 300-row step: the gated MLP runs as two chunks of 150 rows (a bounded intermediate), each row's result
    the bits of the whole-step linears of the Python definition."""
    runner = native_runner(loaded("llama", weights, tmp_path))
    assert "gated_mlp" in runner.model.program.ops()
    assert_program_equals_definition(runner, LONG_STEP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scratch_mib", [6, 1])
def test_a_wide_mlp_runs_in_slabs_or_row_chunks_with_the_same_bits(dtype: torch.dtype, scratch_mib: int,
                                                                  tmp_path: Path) -> None:
    """I = 8192 (a 1.7B model's MLP) at 300 rows: slab by slab of I where the weights take slabs (every level but
    amx: 2,560 columns a slab in 6 MiB, 256 in 1 MiB, or the spare room of another buffer), else in 96-row chunks;
    either way each row's bits and a scratch within the budget."""
    runner = native_runner(loaded("llama", "gguf", tmp_path, intermediate_size=8192, num_hidden_layers=1), dtype)
    program = runner.model.program
    program.set_mlp_scratch_bytes(scratch_mib << 20)
    assert_program_equals_definition(runner, LONG_STEP)
    assert (program.mlp_slab_calls > 0) is (kernels.require().active_isa() != "amx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_scratch_may_be_spare_room_in_another_buffer(dtype: torch.dtype, tmp_path: Path) -> None:
    """With its own scratch lowered to 64 rows, a 300-row gated MLP takes the room past its input in the buffer the
    layer's qkv output left (75 rows of 2I): each row keeps the definition's bits, the input and the cache intact."""
    runner = native_runner(loaded("llama", "gguf", tmp_path), dtype)
    program = runner.model.program
    program.set_mlp_scratch_bytes(1)
    assert_program_equals_definition(runner, LONG_STEP)
    assert program.mlp_spare_calls > 0


def test_program_with_bf16_weights_and_kv_cache(tmp_path: Path) -> None:
    """dtype bfloat16 on the native path: pack_float bf16 weights and a bf16 KV cache; the program still computes
    the definition's bits, and the logits stay the f32 model's up to bf16 rounding."""
    lm = loaded("qwen3", "float", tmp_path)
    f32, bf16 = native_runner(lm), native_runner(lm, torch.bfloat16)
    assert {m.packed.type_name for m in bf16.model.modules() if isinstance(m, (Linear, Embedding))} == {"BF16"}
    assert_program_equals_definition(bf16)
    inp = f32.prepare(STEPS[0])
    with torch.inference_mode():
        a = f32.model.compute_logits(f32.model(inp.input_ids, inp.positions, f32.kv_cache, inp.meta))
        b = bf16.model.compute_logits(bf16.model(inp.input_ids, inp.positions, bf16.kv_cache, inp.meta))
    assert (a - b).abs().max() <= 3e-2 * a.abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_program_is_the_definitions_ops_in_order(kind: str, tmp_path: Path) -> None:
    runner = native_runner(loaded(kind, "gguf", tmp_path))
    program = runner.model.program
    layer = LAYER_OPS[kind]
    assert program.ops() == ["embedding", "rms_norm", *layer, "add_rms_norm", *layer, "add_rms_norm"]
    # buffers for the norms' outputs, the linears' outputs, the attention outputs and the activations, shared by
    # every layer and by each other (never two live values in one; an output takes a dead value's buffer at least
    # as wide: the o projection's the qkv output's): one per width, not per layer; plus the gated MLPs'
    # intermediate ([chunk rows, 2I], the activation written over its first half), shared by all layers
    cfg = runner.model.cfg
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    widths = {cfg.hidden_size, q + 2 * kv, q}
    assert program.num_slots == len(widths) + 1, (program.num_slots, widths)


def live_values(recorder: ProgramRecorder) -> int:
    """The most values the executor holds at once, following the recorded releases."""
    live, most = 0, 0
    for i, ins in enumerate(recorder.instrs):
        live += ins.out >= 0
        most = max(most, live)
        live -= len(recorder.frees.get(i, []))
    return most


def recorded(kind: str, layers: int) -> ProgramRecorder:
    from pdserve.model.native_ops import select_kernels
    from pdserve.model.packed_weights import pack_float_weights

    lm = loaded_from_hf(tiny_model(kind, num_hidden_layers=layers))
    model = LlamaForCausalLM(lm.arch, select_kernels("native"), 64)
    model.load_hf_state_dict(lm.state_dict)
    pack_float_weights(model, torch.float32)
    return record(model)


def test_activations_are_released_layer_by_layer() -> None:
    """A long prefill holds one layer's activations at a time: the values alive at once do not grow with depth,
    and every value but the output is released exactly once."""
    two, six = recorded("qwen3", 2), recorded("qwen3", 6)
    assert live_values(two) == live_values(six) <= 8
    freed = [v for vs in six.frees.values() for v in vs]
    assert len(freed) == len(set(freed)) == len(six.values) - 3  # not the ids, the positions, the output


def test_recorder_refuses_what_it_cannot_express() -> None:
    lib = kernels.require()
    ids, positions = torch.zeros(RECORD_TOKENS, dtype=torch.long), torch.arange(RECORD_TOKENS)
    rec = ProgramRecorder(lib, ids, positions)
    x = rec.embedding(ids, lib.pack_float(torch.randn(10, 8), "f32"))
    w = torch.ones(8)
    with pytest.raises(ProgramUnsupported, match="no native op produced"):
        rec.rms_norm(x * 2, w, 1e-5)  # arithmetic between ops
    with pytest.raises(ProgramUnsupported, match="column slice"):
        rec.rms_norm(x.view(RECORD_TOKENS * 2, 4), torch.ones(4), 1e-5)  # rows regrouped
    with pytest.raises(ProgramUnsupported, match="packs every matrix"):
        rec.linear(x, torch.randn(4, 8), None)  # a float weight the loader did not pack
    rec.rms_norm(x[:, 2:6], torch.ones(4), 1e-5)  # a column slice is fine: one narrow
    assert [i.op for i in rec.instrs] == ["embedding", "narrow", "rms_norm"]


class ScaledEmbeddingLlama(LlamaForCausalLM):
    """Gemma's embedding scale written as Python arithmetic instead of a native op: not recordable."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * 2.0


def test_a_definition_the_recorder_refuses_runs_in_python(tmp_path: Path, caplog: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.model import architectures

    monkeypatch.setitem(architectures.MODEL_CLASSES, "LlamaForCausalLM", ScaledEmbeddingLlama)
    with caplog.at_level(logging.WARNING, logger="pdserve.model.causal_lm"):
        runner = native_runner(loaded("llama", "gguf", tmp_path))
    assert runner.model.program is None and "program unavailable" in caplog.text
    assert len(runner.greedy_step(STEPS[0])) == 2  # the Python definition on the native ops


def test_buffers_reused_across_steps_leave_outputs_intact(tmp_path: Path) -> None:
    """The program keeps its buffers from step to step (grown to the largest step): an output the caller holds is
    not overwritten by the next step, a smaller step after a larger one computes the same as on a fresh program."""
    lm = loaded("llama", "gguf", tmp_path)
    warm, fresh = native_runner(lm), native_runner(lm)
    with torch.inference_mode():
        first = forward(warm, STEPS[0])  # 51 rows: the buffers grow
        kept = first.clone()
        second = forward(warm, STEPS[1])  # 16 rows in the same buffers
        assert torch.equal(first, kept)
        forward(fresh, STEPS[0])
        assert torch.equal(second, forward(fresh, STEPS[1]))


def forward(runner: ModelRunner, step: SchedulerOutput) -> torch.Tensor:
    inp = runner.prepare(step)
    return runner.model(inp.input_ids, inp.positions, runner.kv_cache, inp.meta)



def _greedy(llm: Any, prompts: list[list[int]], n: int = 12) -> list[Any]:
    """Each request's greedy tokens with their logprobs: equal only where every row's arithmetic is."""
    from pdserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
    assert llm.engine.block_manager.is_at_baseline()
    return [(o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs])
            for o in outs]


def test_bf16_preemption_and_chunking_keep_each_rows_arithmetic(make_llm: Any, tokenizer: Any) -> None:
    """bf16 weights and KV on the native kernels, head_dim 64 (where prompt rows run AMX tiles on CPUs that have
    them and generated rows another kernel): requests preempted and recomputed (their generated tokens then sit in
    a prefill chunk) and prompts cut into other chunk sizes give the tokens and logprobs of the same requests run
    alone, unchunked."""
    if not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # head_dim 64
    prompts = [tokenizer.encode(t) for t in ("Hello, my name is", "你好，世界！" * 12, "1, 2, 3, 4, " * 20)]
    alone = make_llm(hf, dtype="bfloat16", kernels="native")
    assert alone.engine.runner.model.program is not None
    want = [_greedy(alone, [p])[0] for p in prompts] * 4
    for options in ({"num_kv_blocks": 24, "max_num_batched_tokens": 64}, {"max_num_batched_tokens": 16}):
        llm = make_llm(hf, dtype="bfloat16", kernels="native", **options)
        assert _greedy(llm, prompts * 4) == want, options
        if "num_kv_blocks" in options:
            assert llm.engine.scheduler.num_preemptions > 0
