"""Split GGUF files as llama.cpp's llama-gguf-split writes them (`-00001-of-00003.gguf`: split.no / split.count as
u16 and split.tensors.count as i32 in every part, the metadata in the first part only, the tensors in order across
the parts), written here by `split_gguf` from a tiny model's single file: loaded from any part's path (or the
directory) equal to the single file, served with the same greedy tokens; missing or mismatched parts refused with a
code and the part named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_loader import BOS, VOCAB_SIZE, tiny_model, write_gguf

from pdserve import SamplingParams, kernels
from pdserve.model.file_errors import ModelFileError
from pdserve.model.file_errors import ModelFileErrorCode as Code
from pdserve.model.gguf_split import part_path
from pdserve.model.loader import load_gguf, resolve_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def split_gguf(src: Path, prefix: Path, counts: list[int]) -> list[Path]:
    """Write `src` as len(counts) parts, part i holding the next counts[i] tensors (0: none), the metadata in the
    first, every part with split.no (u16), split.count (u16) and split.tensors.count (i32), as llama-gguf-split's
    split_strategy writes them."""
    reader = gguf.GGUFReader(str(src))
    tensors = list(reader.tensors)
    assert sum(counts) == len(tensors)
    n = len(counts)
    paths = [Path(part_path(str(prefix), i, n)) for i in range(n)]
    arch = reader.fields["general.architecture"].contents()
    start = 0
    for i, path in enumerate(paths):
        w = gguf.GGUFWriter(str(path), arch)
        if i == 0:  # all metadata in the first split only
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub)
        else:
            w.kv_data[0].pop("general.architecture")
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", n)
        w.add_int32("split.tensors.count", len(tensors))
        for t in tensors[start:start + counts[i]]:
            data = np.array(t.data)
            quantized = t.tensor_type not in (Q.F32, Q.F16)
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type if quantized else None)
        start += counts[i]
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("split")
    single = d / "single" / "tiny.gguf"
    single.parent.mkdir()
    write_gguf(single, tiny_model("qwen3", seed=5), "qwen3",
               qtype=lambda name, w: Q.Q8_0 if "mlp" in name else Q.F32)
    n = len(gguf.GGUFReader(str(single)).tensors)
    (d / "three").mkdir()
    (d / "empty_first").mkdir()
    return {"single": single, "three": split_gguf(single, d / "three" / "tiny", [5, 7, n - 12]),
            "empty_first": split_gguf(single, d / "empty_first" / "tiny", [0, n // 2, n - n // 2])}


def _same_weights(a: Any, b: Any) -> None:
    assert a.hf_config == b.hf_config and a.arch == b.arch and set(a.state_dict) == set(b.state_dict)
    for name, w in a.state_dict.items():
        assert torch.equal(w, b.state_dict[name]), name


@pytest.mark.parametrize("which", ["three", "empty_first"])
def test_loads_from_any_part_as_the_single_file(files: dict[str, Any], which: str) -> None:
    parts = files[which]
    assert [p.name for p in parts] == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf",
                                       "tiny-00003-of-00003.gguf"]
    assert "general.architecture" not in gguf.GGUFReader(str(parts[1])).fields  # metadata in the first part only
    single = load_gguf(str(files["single"]))
    for part in parts:
        lm = load_gguf(str(part))
        _same_weights(lm, single)
        assert lm.source == str(parts[0])  # the first part: metadata and tokenizer
    assert resolve_model_path(str(parts[0].parent)) == str(parts[0])


@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_served_greedy_equals_the_single_file(files: dict[str, Any], kernels_choice: str) -> None:
    from pdserve.llm import LLM

    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    prompts = [{"prompt_token_ids": [BOS, *range(7, 7 + n)]} for n in (5, 40)]
    outs = []
    for model in (files["single"], files["three"][1]):
        llm = LLM(model=str(model), dtype="float32", kernels=kernels_choice, device_peaks="off", max_step_ms=0,
                  num_kv_blocks=64, max_model_len=128)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        assert llm.engine.block_manager.is_at_baseline()
    assert outs[0] == outs[1] and all(len(t) == 16 and max(t) < VOCAB_SIZE for t in outs[0])


def test_missing_part_is_named(files: dict[str, Any], tmp_path: Path) -> None:
    for part in files["three"]:
        shutil.copy(part, tmp_path / part.name)
    os.remove(tmp_path / "tiny-00002-of-00003.gguf")
    for name in ("tiny-00001-of-00003.gguf", "tiny-00003-of-00003.gguf"):
        with pytest.raises(ModelFileError, match="1 of its 3 parts are missing \\(tiny-00002-of-00003.gguf\\)") as e:
            load_gguf(str(tmp_path / name))
        assert e.value.code == Code.GGUF_SPLIT_MISSING_PART


def test_inconsistent_parts_are_refused(files: dict[str, Any], tmp_path: Path) -> None:
    """A part of another split set (other tensor total), and a part renamed so that its name hides the set."""
    other = split_gguf(files["single"], tmp_path / "other", [5, 7, len(gguf.GGUFReader(str(files["single"])).tensors)
                                                             - 12])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(files["three"][0], mixed / "tiny-00001-of-00003.gguf")
    shutil.copy(files["three"][1], mixed / "tiny-00002-of-00003.gguf")
    shutil.copy(other[1], mixed / "tiny-00003-of-00003.gguf")  # split.no 1 where 2 belongs
    with pytest.raises(ModelFileError, match="tiny-00003-of-00003.gguf does not belong") as e:
        load_gguf(str(mixed / "tiny-00001-of-00003.gguf"))
    assert e.value.code == Code.GGUF_SPLIT_INCONSISTENT
    renamed = tmp_path / "tiny-part1.gguf"
    shutil.copy(files["three"][0], renamed)
    with pytest.raises(ModelFileError, match="part 1 of a 3-part split GGUF") as e:
        load_gguf(str(renamed))
    assert e.value.code == Code.GGUF_SPLIT_UNNAMED
