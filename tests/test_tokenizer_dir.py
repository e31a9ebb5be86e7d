"""load_tokenizer_dir builds a saved tokenizer directory as AutoTokenizer would, skipping the model config only where
transformers' own rules make the config irrelevant; elsewhere it defers to AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pdserve.model.tokenizer_dir import direct_class_applies, load_tokenizer_dir

TEXTS = ["Hello world, how are you?", "今天天气很好，我们去公园散步吧。", "<|im_start|>user\nhi<|im_end|>",
         "  spaces\t\n"]
MESSAGES = [{"role": "system", "content": "你是一个乐于助人的助手。"}, {"role": "user", "content": "What is 2+2?"}]


def same_tokenizer(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a(text, add_special_tokens=False)["input_ids"] == b(text, add_special_tokens=False)["input_ids"]
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, a.model_max_length) == \
        (b.bos_token_id, b.eos_token_id, b.pad_token_id, b.model_max_length)
    assert a.all_special_tokens == b.all_special_tokens and len(a) == len(b)


def edited(src: Path, dst: Path, file: str, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text())
    data.update(changes)
    (dst / file).write_text(json.dumps(data))
    return dst


def test_a_generic_fast_tokenizer_loads_directly_and_equals_autotokenizer(tiny_dir: Path) -> None:
    assert direct_class_applies(str(tiny_dir))
    same_tokenizer(load_tokenizer_dir(str(tiny_dir)), AutoTokenizer.from_pretrained(str(tiny_dir)))


def test_without_a_model_config_it_still_equals_autotokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "tok"
    shutil.copytree(tiny_dir, d)
    (d / "config.json").unlink()
    assert direct_class_applies(str(d))
    same_tokenizer(load_tokenizer_dir(str(d)), AutoTokenizer.from_pretrained(str(d)))


@pytest.mark.parametrize("file, changes", [
    ("config.json", {"model_type": "qwen2"}),  # transformers lists its Hub class as wrong: the config decides
    ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}),  # remote code
    ("tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer"}),  # a specific class
])
def test_other_directories_go_through_autotokenizer(tiny_dir: Path, tmp_path: Path, file: str,
                                                     changes: dict[str, Any]) -> None:
    assert not direct_class_applies(str(edited(tiny_dir, tmp_path / "tok", file, **changes)))


def test_a_model_type_registered_to_mistrals_tokenizer_goes_through_autotokenizer(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.auto import tokenization_auto

    assert direct_class_applies(str(tiny_dir))  # llama: no registered class here
    monkeypatch.setitem(tokenization_auto.TOKENIZER_MAPPING_NAMES, "llama", "MistralCommonBackend")
    assert not direct_class_applies(str(tiny_dir))  # AutoTokenizer may pick Mistral's own format for it


def test_a_directory_without_tokenizer_json_goes_through_autotokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "tok"
    shutil.copytree(tiny_dir, d)
    (d / "tokenizer.json").unlink()
    assert not direct_class_applies(str(d))
    assert not direct_class_applies(str(tmp_path / "missing"))
