"""Tests for pdserve.engine.detokenizer.IncrementalDetokenizer against the real SmolLM2 (byte-level BPE) tokenizer."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine import detokenizer as detok_mod
from pdserve.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="session")
def tok(tokenizer: Any) -> Any:
    """The default model's tokenizer (conftest: converted once per session, never in the user's cache)."""
    return tokenizer


def enc(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    tok: Any, prompt: list[int], out: list[int], *, step: int = 1, finish: bool = True, **kw: Any
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `out` `step` tokens at a time, collecting the deltas the engine would stream."""
    d = IncrementalDetokenizer(tok, prompt, **kw)
    deltas: list[str] = []
    stop = None
    for i in range(0, len(out), step):
        last = i + step >= len(out)
        stop = d.update(out[i : i + step], finished_by_engine=finish and last)
        done = stop is not None or (finish and last)
        deltas.append(d.get_delta(done))
        # Invariant: what was streamed is always a prefix of the (current) output text.
        assert d.output_text.startswith("".join(deltas))
        if stop is not None:
            break
    if not finish and stop is None:
        deltas.append(d.get_delta(True))
    return d, deltas, stop


CHINESE = "你好，世界！今天天气很好。"
EMOJI = "🙂👍🏽🇨🇳"
MIXED = "Hello 世界, this is a test: 天气很好 🙂 and done.\n\n  新的一行 👍🏽!"


@pytest.mark.parametrize("text", [CHINESE, EMOJI, MIXED, "plain ascii text, nothing special"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_matches_decode(tok: Any, text: str, step: int) -> None:
    prompt = enc(tok, "User: say something")
    out = enc(tok, text)
    d, deltas, stop = stream(tok, prompt, out, step=step)
    assert stop is None
    for delta in deltas:
        assert FFFD not in delta
    assert "".join(deltas) == d.output_text == tok.decode(out, skip_special_tokens=True) == text


def test_split_characters_are_held_back(tok: Any) -> None:
    out = enc(tok, CHINESE)
    assert len(out) > len(CHINESE)  # the test is meaningful: characters really span tokens
    d = IncrementalDetokenizer(tok, [])
    for i, t in enumerate(out):
        d.update([t])
        # Confirmed text is always the longest decodable-without-U+FFFD prefix of the decode.
        full = tok.decode(out[: i + 1])
        assert d.output_text == full.rstrip(FFFD)


def test_matches_decode_stream_chunks(tok: Any) -> None:
    """Same chunking as tokenizers' DecodeStream on well-formed text (no stops, no holdback)."""
    dec = pytest.importorskip("tokenizers.decoders")
    if not hasattr(dec, "DecodeStream"):
        pytest.skip("tokenizers too old for DecodeStream")
    out = enc(tok, MIXED + CHINESE + EMOJI)
    ds = dec.DecodeStream(skip_special_tokens=True)
    d = IncrementalDetokenizer(tok, [])
    for t in out:
        d.update([t])
        assert d.get_delta(False) == (ds.step(tok.backend_tokenizer, t) or "")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, skip: bool) -> None:
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt = [im_start] + enc(tok, "assistant\n")
    out = enc(tok, "世界") + [im_end] + enc(tok, " ok 🙂") + [im_end]
    d, deltas, _ = stream(tok, prompt, out, skip_special_tokens=skip)
    expected = tok.decode(out, skip_special_tokens=skip)
    assert "".join(deltas) == d.output_text == expected
    assert ("<|im_end|>" in expected) is (not skip)


def test_special_token_inside_split_character(tok: Any) -> None:
    # Skipped special tokens between the bytes of one character decode to nothing and must not break it.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out = enc(tok, "界")
    assert len(out) >= 2
    out = out[:1] + [im_end, im_end] + out[1:]
    d, deltas, _ = stream(tok, [], out)
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == tok.decode(out, skip_special_tokens=True) == "界"


def test_incomplete_tail_flushed_like_decode(tok: Any) -> None:
    out = enc(tok, "abc界")[:-1]  # ends in the middle of 界
    d = IncrementalDetokenizer(tok, [])
    d.update(out)
    assert d.get_delta(False) == "abc"
    assert d.update([], finished_by_engine=True) is None
    assert d.output_text == tok.decode(out) and d.output_text.endswith(FFFD)
    assert d.get_delta(True) == FFFD


def test_sampled_invalid_bytes_mid_text(tok: Any) -> None:
    # SmolLM2 in bf16 on a Zen 5, "用一句话描述春天：" at temperature 0.9: "认" then "è¯" + "en" (two bytes of a
    # three-byte character, then ASCII). The broken character is the model's: one U+FFFD, as tokenizer.decode gives.
    out = [15076, 240, 15076, 122, 22081, 114, 16313, 264, 41479, 178, 243, 139, 37145, 218, 27948, 229, 44846, 118]
    want = tok.decode(out)
    assert want == "他们认" + FFFD + "en大百秀之雨"
    for step in (1, 2, 5):
        d, deltas, _ = stream(tok, enc(tok, "用一句话描述春天："), out, step=step)
        assert "".join(deltas) == d.output_text == want


def test_prompt_ending_mid_character(tok: Any) -> None:
    ids = enc(tok, "hi 界")
    prompt, out = ids[:-1], ids[-1:] + enc(tok, "ok")  # the prompt ends with the first bytes of 界
    d, deltas, _ = stream(tok, prompt, out)
    assert "".join(deltas) == tok.decode(out) == FFFD + "ok"


# ---------------------------------------------------------------- stop strings


def _check_stop(tok: Any, text: str, stop: list[str], include: bool, step: int, expect_stop: str, expect: str) -> None:
    out = enc(tok, text)
    d, deltas, s = stream(tok, enc(tok, "Q:"), out, step=step, stop=stop, include_stop_str_in_output=include)
    assert s == expect_stop
    assert d.stop_str == expect_stop
    assert d.output_text == expect
    assert "".join(deltas) == expect
    for delta in deltas:
        assert FFFD not in delta
    if not include:  # no part of the matched stop string was ever streamed
        assert expect_stop not in "".join(deltas)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_chinese_spanning_tokens(tok: Any, include: bool, step: int) -> None:
    # "世界" is 5 tokens with SmolLM2 (both characters split) -- the stop string spans several tokens.
    assert len(enc(tok, "世界")) > 2
    expect = "你好，世界" if include else "你好，"
    _check_stop(tok, CHINESE, ["世界"], include, step, "世界", expect)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("step", [1, 3])
def test_stop_english_spanning_tokens(tok: Any, include: bool, step: int) -> None:
    text = "The quick brown fox jumps over the lazy dog. The end."
    stop = "fox jumps ov"
    assert len(enc(tok, stop)) > 2
    expect = text[: text.index(stop) + (len(stop) if include else 0)]
    _check_stop(tok, text, [stop], include, step, stop, expect)


def test_stop_emoji(tok: Any) -> None:
    _check_stop(tok, "x " + EMOJI + " y", ["👍🏽"], False, 1, "👍🏽", "x 🙂")


@pytest.mark.parametrize("step", [1, 100])
def test_multiple_stops_earliest_wins(tok: Any, step: int) -> None:
    text = "alpha beta gamma delta"
    # "gamma" is listed first but "beta" occurs earlier; "a b" starts even earlier (inside "alpha beta").
    _check_stop(tok, text, ["gamma", "beta"], False, step, "beta", "alpha ")
    _check_stop(tok, text, ["gamma", "beta", "a b"], False, step, "a b", "alph")
    _check_stop(tok, text, ["gamma", "beta", "a b"], True, step, "a b", "alpha b")


def test_stop_in_prompt_does_not_trigger(tok: Any) -> None:
    prompt = enc(tok, "Please say 世界 and STOP here. STOP")
    out = enc(tok, " fine, 你好")
    d, deltas, s = stream(tok, prompt, out, stop=["世界", "STOP"])
    assert s is None and d.stop_str is None
    assert "".join(deltas) == d.output_text == " fine, 你好"


def test_stop_across_prompt_boundary_does_not_trigger(tok: Any) -> None:
    # Prompt ends with "ST", output starts with "OP": only output text is searched.
    prompt = enc(tok, "ends with ST")
    out = enc(tok, "OP and more")
    d, deltas, s = stream(tok, prompt, out, stop=["STOP"])
    assert s is None and "".join(deltas) == tok.decode(out)


def test_partial_stop_prefix_released_when_finished(tok: Any) -> None:
    # The output ends with a prefix of a stop string that never completes: held back while streaming,
    # then released on finish.
    out = enc(tok, "answer: 世")
    d = IncrementalDetokenizer(tok, [], stop=["世界!"])
    streamed = ""
    for t in out:
        assert d.update([t]) is None
        streamed += d.get_delta(False)
    assert streamed == "answer:"  # last len("世界!") - 1 = 2 chars (" 世") held back
    d.update([], finished_by_engine=True)
    assert streamed + d.get_delta(True) == "answer: 世" == d.output_text


def test_holdback_and_tokens_after_stop_ignored(tok: Any) -> None:
    d = IncrementalDetokenizer(tok, [], stop=["END"])
    d.update(enc(tok, "abcdef"))
    assert d.get_delta(False) == "abcd"  # holds back len("END") - 1 = 2 chars
    assert d.update(enc(tok, " xEN")) is None
    assert d.get_delta(False) == "ef x"
    assert d.update(enc(tok, "D tail")) == "END"
    assert d.update(enc(tok, " more END")) is None  # finished: ignored
    assert d.get_delta(True) == ""  # "EN" was held back and is now cut
    assert d.output_text == "abcdef x"


def test_stop_found_in_flushed_tail(tok: Any) -> None:
    d = IncrementalDetokenizer(tok, [], stop=["xy"])
    ids = enc(tok, "axy界")[:-1]  # ["axy", partial 界]: the decode ends in U+FFFD, so "axy" is still pending
    stop = d.update(ids, finished_by_engine=True)
    assert stop == "xy" and d.output_text == "a" and d.get_delta(True) == "a"


def test_min_tokens_defers_stop_strings(tok: Any) -> None:
    out = enc(tok, "ab 世界 cd 世界 ef")
    n_first = len(enc(tok, "ab 世界"))
    # The first occurrence completes at token n_first: ignored below min_tokens, the second one then matches.
    d, deltas, s = stream(tok, [], out, stop=["世界"], min_tokens=n_first + 1)
    assert s == "世界" and "".join(deltas) == d.output_text == "ab 世界 cd "
    d, deltas, s = stream(tok, [], out, stop=["世界"], min_tokens=n_first)
    assert s == "世界" and d.output_text == "ab "
    d, deltas, s = stream(tok, [], out, stop=["世界"], min_tokens=len(out) + 1)
    assert s is None and "".join(deltas) == tok.decode(out)


def test_empty_and_single_char_stops(tok: Any) -> None:
    d, deltas, s = stream(tok, [], enc(tok, "a,b;c"), stop=["", ";"])
    assert s == ";" and d.output_text == "a,b" and "".join(deltas) == "a,b"


# ---------------------------------------------------------------- property tests

_texts = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
        st.sampled_from([" ", "\n", "a", "e", "🏽", "\u200d"]),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(_texts, min_size=1, max_size=3),
    cut=st.integers(0, 3),
    step=st.integers(1, 4),
    skip=st.booleans(),
    data=st.data(),
)
def test_property_concat_equals_decode(
    tok: Any, texts: list[str], cut: int, step: int, skip: bool, data: st.DataObject
) -> None:
    # Concatenate encodings of independent texts (joins may split characters) and drop a few leading ids
    # (the output may start mid-character); sprinkle special tokens in.
    ids: list[int] = []
    for t in texts:
        ids += enc(tok, t)
    ids = ids[cut:]
    if ids and data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(ids)))
        ids.insert(pos, data.draw(st.sampled_from([0, 1, 2])))
    prompt = enc(tok, data.draw(_texts))
    d, deltas, s = stream(tok, prompt, ids, step=step, skip_special_tokens=skip)
    assert s is None
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.one_of(st.integers(0, 2), st.integers(100, 400), st.integers(0, 49151)), max_size=60),
    prompt=st.lists(st.integers(100, 400), max_size=8),
    step=st.integers(1, 3),
    skip=st.booleans(),
)
def test_property_random_ids(tok: Any, ids: list[int], prompt: list[int], step: int, skip: bool) -> None:
    # Arbitrary ids (ids 100..400 are mostly single-byte tokens: long invalid UTF-8 runs, characters split
    # at random, a prompt ending mid-character): tokenizer.decode still rules, U+FFFD included.
    d, deltas, _ = stream(tok, prompt, ids, step=step, skip_special_tokens=skip)
    assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts, stop_from=st.integers(0, 40), stop_len=st.integers(1, 4), include=st.booleans(), data=st.data())
def test_property_stop_never_leaks(
    tok: Any, text: str, stop_from: int, stop_len: int, include: bool, data: st.DataObject
) -> None:
    stop = text[stop_from : stop_from + stop_len] or data.draw(_texts.filter(bool))
    out = enc(tok, text)
    d, deltas, s = stream(
        tok, [], out, step=data.draw(st.integers(1, 3)), stop=[stop], include_stop_str_in_output=include
    )
    streamed = "".join(deltas)
    assert streamed == d.output_text
    decoded = tok.decode(out)
    if stop in decoded:
        i = decoded.index(stop)
        assert s == stop
        assert streamed == (decoded[: i + len(stop)] if include else decoded[:i])
    else:
        assert s is None and streamed == decoded


# ---------------------------------------------------------------- cost


def test_window_is_bounded(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-token work is O(window): decode never sees more than a few dozen ids, however long the output."""
    sizes: list[int] = []
    orig = IncrementalDetokenizer._decode

    def spy(self: IncrementalDetokenizer, ids: list[int]) -> str:
        sizes.append(len(ids))
        return orig(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode", spy)
    out = enc(tok, (MIXED + CHINESE + EMOJI) * 40)
    d = IncrementalDetokenizer(tok, enc(tok, "prompt " * 500), stop=["never-matches"])
    for t in out:
        d.update([t])
        d.get_delta(False)
    assert len(out) > 1000
    assert max(sizes) <= detok_mod._PROMPT_CONTEXT + 2 * detok_mod._MAX_PENDING
    assert len(d._ids) <= detok_mod._COMPACT_AT + 2 * detok_mod._MAX_PENDING
    # Garbage: a long run of lone continuation bytes (invalid UTF-8 forever) must not grow the window either.
    cont = tok.convert_tokens_to_ids("Ģ")  # byte-level symbol of byte 0x80 (a lone continuation byte)
    assert tok.decode([cont]) == FFFD
    d = IncrementalDetokenizer(tok, [])
    sizes.clear()
    for _ in range(200):
        d.update([cont])
    assert max(sizes) <= 2 * detok_mod._MAX_PENDING + 2


def test_per_token_cost(tok: Any) -> None:
    out = enc(tok, (MIXED + " some more english words here. " + CHINESE) * 30)[:1000]
    assert len(out) == 1000
    d = IncrementalDetokenizer(tok, enc(tok, "prompt"), stop=["never-matches", "也不"])
    t0 = time.perf_counter()
    for t in out:
        d.update([t])
        d.get_delta(False)
    us = (time.perf_counter() - t0) / len(out) * 1e6
    print(f"\nper-token update+get_delta: {us:.1f} us")
    assert us < 500  # generous: shared CI cores


def test_many_long_stop_strings_match_and_stay_cheap(tok: Any) -> None:
    """The largest stop list SamplingParams allows (64 strings x 1024 characters) costs O(total stop characters)
    per token at worst: near-misses ending in common characters, duplicates, and the real stop listed last."""
    from pdserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    text = "The quick brown fox jumps over the lazy dog. 你好，世界！" * 12 + " STOP here"
    near = ["e" * (MAX_STOP_STRING_CHARS - 1) + c for c in "e o,!。界好"]
    stops = (near * MAX_STOP_STRINGS)[: MAX_STOP_STRINGS - 2] + ["世界！ STOP", "STOP"]
    out = enc(tok, text)
    t0 = time.perf_counter()
    d, deltas, s = stream(tok, enc(tok, "Q:"), out, stop=stops)
    elapsed = time.perf_counter() - t0
    # both listed last; "世界！ STOP" starts earlier, so it wins
    assert s == "世界！ STOP" and d.output_text == text[: text.index("世界！ STOP")] == "".join(deltas)
    assert len(d.stop) == len(near) + 2  # duplicates searched once
    assert elapsed < 0.05 * len(out)  # generous: ~50 us per token in practice; guards against superlinear blowups


def test_skipped_special_tokens_do_not_split_a_character(tok: Any) -> None:
    """Under skip_special_tokens the decode drops special tokens before joining bytes: a character whose bytes lie
    on both sides of them (here 0xC2 | <|endoftext|> x 3 | 0xA1, "¡") comes out whole, as tokenizer.decode gives it,
    whatever number of special tokens come before (they once counted toward the pending-token bound)."""
    c2, a1 = tok.convert_tokens_to_ids(["Â", "¡"])  # byte-level BPE tokens of the bytes 0xC2, 0xA1
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    for lead in (0, 5, 20):
        ids = [eos] * lead + [c2, eos, eos, eos, a1]
        for step in (1, 2):
            d, deltas, _ = stream(tok, [], ids, step=step, skip_special_tokens=True)
            assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=True) == "¡"
            d, deltas, _ = stream(tok, [], ids, step=step, skip_special_tokens=False)
            assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=False)
