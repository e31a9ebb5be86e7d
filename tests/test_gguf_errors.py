"""GGUF files pdserve cannot serve are refused before any tensor is read, with a ModelFileError whose code says why
and whose message names the architecture, tensor or type: an unknown architecture, tensors the architecture does
not have (MoE experts in a dense architecture), a ggml type neither the kernels nor `gguf` can read, a type number
the gguf package does not know; through `LLM` as well."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_loader import tiny_model, write_gguf

from pdserve.model.file_errors import ModelFileError
from pdserve.model.file_errors import ModelFileErrorCode as Code
from pdserve.model.loader import load_gguf


def _refused(path: Path, code: Code, match: str, keep_quantized: bool = False) -> None:
    with pytest.raises(ModelFileError, match=match) as e:
        load_gguf(str(path), keep_quantized=keep_quantized)
    assert e.value.code == code


def test_unknown_architecture(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    data = (tmp_path / "m.gguf").read_bytes().replace(b"llama", b"mamba", 1)  # general.architecture's value
    (tmp_path / "mamba.gguf").write_bytes(data)
    _refused(tmp_path / "mamba.gguf", Code.UNSUPPORTED_ARCHITECTURE, "unsupported GGUF architecture 'mamba'.*llama")


def test_tensors_the_architecture_lacks(tmp_path: Path) -> None:
    def experts(w: gguf.GGUFWriter) -> None:
        w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 128, 64), dtype=np.float32))

    write_gguf(tmp_path / "moe.gguf", tiny_model("qwen3"), "qwen3", extra=experts)
    _refused(tmp_path / "moe.gguf", Code.UNSUPPORTED_TENSORS, "'qwen3'.*blk.0.ffn_gate_exps.weight")


def _with_type(src: Path, dst: Path, tensor: str, ggml_type: int) -> None:
    """`src` with `tensor`'s ggml type number in its header set to `ggml_type` (its data left as it is)."""
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # its tensor info: n_dims, ne, type
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_type_nothing_can_read(tmp_path: Path, keep_quantized: bool) -> None:
    """Q8_1 (llama.cpp's activation format, not a weight format): neither packed nor dequantizable by gguf."""
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    _with_type(tmp_path / "m.gguf", tmp_path / "q81.gguf", "blk.1.attn_q.weight", int(Q.Q8_1))
    _refused(tmp_path / "q81.gguf", Code.UNSUPPORTED_TENSOR_TYPE, "blk.1.attn_q.weight .* is Q8_1", keep_quantized)


def test_type_number_gguf_does_not_know(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    _with_type(tmp_path / "m.gguf", tmp_path / "new.gguf", "output_norm.weight", 250)
    _refused(tmp_path / "new.gguf", Code.UNSUPPORTED_TENSOR_TYPE, "output_norm.weight has ggml type 250")


def test_llm_reports_it(tmp_path: Path) -> None:
    from pdserve.llm import LLM

    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    (tmp_path / "x.gguf").write_bytes((tmp_path / "m.gguf").read_bytes().replace(b"llama", b"mamba", 1))
    with pytest.raises(ModelFileError, match="'mamba'") as e:
        LLM(model=str(tmp_path / "x.gguf"), dtype="float32", kernels="torch")
    assert e.value.code == Code.UNSUPPORTED_ARCHITECTURE
