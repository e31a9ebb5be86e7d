"""The benchmark's model files (benchmarks/make_models.py, benchmarks/serve_sizes.py): a random-weight Llama GGUF
written as make_models writes the 1.7B and 7B shapes, at a tiny size, loads in pdserve with the default model's
tokenizer, generates finite logits, and the bandwidth floor counts the bytes a decode step reads."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from make_models import SHAPES, Shape, tensor_shapes, write_f16  # noqa: E402
from serve_sizes import weight_bytes_per_token  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.model.loader import resolve_model_path  # noqa: E402

TINY = {tied: Shape(64, 2, 4, 2, 128, 49152, tied, 130000.0, 512) for tied in (True, False)}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """Both tiny GGUFs, written once for the module: each write parses the default model's GGUF for its tokenizer
    fields in pure Python (~10 s on a busy host); the tests only read the files."""
    d = tmp_path_factory.mktemp("bench-models")
    paths = {tied: d / f"tiny-{'tied' if tied else 'untied'}.F16.gguf" for tied in TINY}
    for tied, path in paths.items():
        write_f16(path, "tiny", TINY[tied], Path(resolve_model_path(None)), seed=0, pool_size=1 << 16)
    return paths


@pytest.mark.parametrize("tied", [True, False])
def test_random_gguf_loads_and_generates(tiny_ggufs: dict[bool, Path], tied: bool) -> None:
    path = tiny_ggufs[tied]
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == [n for n, _ in tensor_shapes(TINY[tied])]
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    w = np.asarray(reader.tensors[2].data, dtype=np.float32)  # blk.0.attn_q
    assert 0.015 < float(w.std()) < 0.025
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="64MiB", max_model_len=512, device_peaks="off")
    out = llm.generate(["The capital of France is", "北京是"], SamplingParams(max_tokens=8, temperature=0,
                                                                            ignore_eos=True, logprobs=1))
    for o in out:
        assert len(o.outputs[0].token_ids) == 8
        lps = o.outputs[0].logprobs
        assert [lp.token_id for lp in lps] == o.outputs[0].token_ids
        assert all(np.isfinite(lp.logprob) for lp in lps)


@pytest.mark.parametrize("tied", [True, False])
def test_floor_counts_the_weights_a_step_reads(tiny_ggufs: dict[bool, Path], tied: bool) -> None:
    s = TINY[tied]
    info = weight_bytes_per_token(str(tiny_ggufs[tied]))
    layer = 2 * (2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * 32 + 3 * s.hidden_size * 128)
    head = 2 * s.vocab_size * s.hidden_size  # the output matrix; the embedding (untied) is one row a step
    norms = 4 * s.hidden_size * (2 * s.num_hidden_layers + 1)
    assert info["bytes_per_token"] == s.num_hidden_layers * layer + head + norms
    assert info["tied"] is tied
    assert info["types"] == {"F16": 1 + 7 * s.num_hidden_layers + (not tied), "F32": 2 * s.num_hidden_layers + 1}


def test_shapes_are_the_real_models() -> None:
    def params(s: Shape) -> int:
        return sum(int(np.prod(shp)) for _, shp in tensor_shapes(s))

    assert 1.70e9 < params(SHAPES["1.7b"]) < 1.72e9  # SmolLM2-1.7B: 1.711 B
    assert 6.87e9 < params(SHAPES["7b"]) < 6.89e9  # Llama-2-7B (6.738 B) with a 49152 vocab instead of 32000
