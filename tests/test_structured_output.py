"""Structured output (constrained decoding with xgrammar): the tiny random model emits garbage, which is exactly
what a constraint must tame. Outputs run until the grammar completes (`finish_reason == "stop"`); each test gives
`max_tokens` enough for that, and a `length` finish is a failure, not a pass."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.errors import ErrorCode, RequestRejected
from pdserve.launch import ServerProc
from pdserve.sampling_params import SamplingParams, StructuredOutputs

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "中文"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "蓝色"]},
                                      "note": {"type": "string", "maxLength": 4}},
     "required": ["color"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                      "ok": {"type": "boolean"}}, "required": ["code", "ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "minItems": 2, "maxItems": 4},
]


def greedy(max_tokens: int = 120, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm(tiny_hf_model: Any, tokenizer: Any) -> Any:
    from pdserve.llm import LLM
    from tests.conftest import loaded_from_hf

    return LLM(loaded_model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer, dtype="float32",
               device_peaks="off", num_kv_blocks=256)


def kv_idle(llm: Any) -> None:
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and not llm.engine.scheduler.requests


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_parse_and_validate_in_a_batch(llm: Any, temperature: float) -> None:
    prompts = ["Give me JSON:", "写一个 JSON 对象", "x"]
    plain = greedy(24)
    base = llm.generate(prompts, plain)
    params = [SamplingParams(temperature=temperature, seed=7, max_tokens=150,
                             structured_outputs=StructuredOutputs(json=s)) for s in SCHEMAS]
    outs = llm.generate(prompts + prompts[:1] * len(SCHEMAS), [plain] * len(prompts) + params)
    for schema, out in zip(SCHEMAS, outs[len(prompts):]):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    # unconstrained neighbours: same greedy output as alone
    assert [o.outputs[0].token_ids for o in outs[:len(prompts)]] == [o.outputs[0].token_ids for o in base]
    kv_idle(llm)


def test_choice_regex_grammar_json_object(llm: Any) -> None:
    choices = ["yes", "no", "也许 maybe"]
    outs = llm.generate(["Q:"] * 5, [
        greedy(structured_outputs=StructuredOutputs(choice=choices)),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40, structured_outputs={"choice": choices}),
        greedy(structured_outputs=StructuredOutputs(regex=r"\d{3}-[a-z]{2,4}")),
        greedy(structured_outputs=StructuredOutputs(grammar='root ::= "(" [0-9]+ ")" | "你好"')),
        greedy(200, structured_outputs=StructuredOutputs(json_object=True)),
    ])
    assert outs[0].outputs[0].text in choices
    assert len(outs[1].outputs) == 3 and all(c.text in choices for c in outs[1].outputs)
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", outs[2].outputs[0].text)
    assert re.fullmatch(r"\([0-9]+\)|你好", outs[3].outputs[0].text)
    assert isinstance(json.loads(outs[4].outputs[0].text), dict)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    kv_idle(llm)


def test_stop_strings_and_ignore_eos_still_apply(llm: Any) -> None:
    out = llm.generate("Q:", greedy(stop=["-"], structured_outputs=StructuredOutputs(regex=r"\d{3}-[a-z]{2}")))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "-" and re.fullmatch(r"\d{3}", c.text)
    out = llm.generate("Q:", greedy(ignore_eos=True, min_tokens=50, structured_outputs={"choice": ["ab", "c"]}))
    assert out[0].outputs[0].text in ("ab", "c") and out[0].outputs[0].finish_reason == "stop"
    kv_idle(llm)


def test_preemption_keeps_matchers_valid(tiny_hf_model: Any, tokenizer: Any) -> None:
    from pdserve.llm import LLM
    from tests.conftest import loaded_from_hf

    small = LLM(loaded_model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer, dtype="float32",
                device_peaks="off", num_kv_blocks=24, block_size=16, max_num_seqs=8)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 20,
              "maxItems": 20}
    params = SamplingParams(temperature=0.0, max_tokens=150, structured_outputs={"json": schema})
    outs = small.generate([f"prompt {i}" for i in range(6)], params)
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert small.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("so, param", [
    ({"json": {"type": "nonsense"}}, "json"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"json": "{not json"}, "json"),
    ({"choice": []}, "choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
    ({}, "structured_outputs"),
])
def test_bad_constraints_are_rejected(llm: Any, so: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestRejected) as e:
        llm.engine.make_requests(["x"], SamplingParams(structured_outputs=so), "bad")
    assert e.value.code == ErrorCode.INVALID_STRUCTURED_OUTPUT and e.value.param == param
    kv_idle(llm)


def test_unknown_key_is_refused_and_compile_is_cached(llm: Any) -> None:
    with pytest.raises(RequestRejected) as e:
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    assert e.value.code == ErrorCode.UNSUPPORTED_PARAMETER and e.value.param == "structured_outputs.whitespace_pattern"
    mgr = llm.engine.structured
    so = StructuredOutputs(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    mgr.compile(so)
    n = mgr.num_compiled
    same = StructuredOutputs(json=json.dumps({"properties": {"k": {"type": "integer"}}, "type": "object"},
                                             sort_keys=True))
    assert mgr.compile(same) is mgr.compile(so) and mgr.num_compiled == n


# ---- against a real server, with the official openai client -------------------------------------------------
class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    mood: Literal["happy", "sad", "平静"]
    tags: list[Literal["x", "y"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def server(tiny_server: ServerProc) -> ServerProc:
    """The session's tiny server (conftest): this module only sends requests and checks its own answers and the
    pool back at baseline."""
    return tiny_server


def wait_idle(srv: ServerProc, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv").json()
        if kv["num_used_blocks"] == 0 and kv["open_requests"] == 0:
            return
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


@pytest.mark.slow
def test_openai_client_structured_outputs(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    msgs: Any = [{"role": "user", "content": "介绍一个人"}]
    model = client.models.list().data[0].id

    def neighbour() -> str:
        return client.completions.create(model=model, prompt="你好 neighbour", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    ref = neighbour()

    def parsed() -> Person | None:
        r = client.chat.completions.parse(model=model, messages=msgs, response_format=Person,
                                          max_completion_tokens=200, temperature=0)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.parsed

    def guided(body: dict[str, Any]) -> Any:
        return client.completions.create(model=model, prompt="Answer:", max_tokens=60, temperature=0.8, seed=1,
                                         n=2, extra_body=body)

    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(neighbour), pool.submit(parsed), pool.submit(guided, {"guided_choice": ["是", "否"]}),
                pool.submit(guided, {"structured_outputs": {"regex": "[0-9]{4}"}}),
                pool.submit(guided, {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "k", "schema": schema}}}),
                pool.submit(neighbour)]
        res = [f.result() for f in futs]
    assert res[0] == res[5] == ref  # unconstrained neighbours unaffected
    assert isinstance(res[1], Person)
    assert {c.text for c in res[2].choices} <= {"是", "否"} and len(res[2].choices) == 2
    assert all(re.fullmatch("[0-9]{4}", c.text) for c in res[3].choices)
    for c in res[4].choices:
        jsonschema.validate(json.loads(c.text), schema)
    # streamed: the concatenated deltas validate (a bounded schema: free strings from a random model run long)
    rf: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    chunks = list(client.chat.completions.create(model=model, messages=msgs, response_format=rf, stream=True,
                                                 max_completion_tokens=200, temperature=0))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Person.model_validate_json(text)
    wait_idle(server)
    # a bad schema: 400 with OpenAI's body, nothing left allocated
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, extra_body={"guided_json": {"type": 5}})
    assert e.value.status_code == 400 and isinstance(e.value.body, dict)
    assert e.value.body["code"] == "invalid_structured_output" and e.value.body["param"] == "guided_json"
    wait_idle(server)


def test_grammar_cache_is_bounded_in_bytes_and_a_huge_grammar_is_refused(tokenizer: Any) -> None:
    """Compiled grammars (tool sets: ~20 KB to MBs each) are cached within a byte bound, not only a count; one
    grammar over the per-constraint bound is a 400 invalid_structured_output naming the field, and is not cached."""
    from pdserve.engine.structured import StructuredOutputManager
    from pdserve.errors import ErrorCode, RequestRejected
    from pdserve.sampling_params import StructuredOutputs

    m = StructuredOutputManager(tokenizer, 49152, [2])

    def schema(i: int, props: int = 4) -> StructuredOutputs:
        return StructuredOutputs(json={"type": "object", "properties": {f"k{i}_{j}": {"type": "string"}
                                                                        for j in range(props)}}, param="tools")
    sizes = [m.compile(schema(i)).memory_size_bytes for i in range(3)]
    m.cache_bytes = 2 * max(sizes)  # room for two
    for i in range(3, 10):
        m.compile(schema(i))
        assert 1 <= len(m._cache) <= 2 and m._cache_bytes <= m.cache_bytes
        assert m._cache_bytes == sum(g.memory_size_bytes for g in m._cache.values())
    m.max_grammar_bytes = min(sizes) - 1
    with pytest.raises(RequestRejected) as e:
        m.compile(schema(99))
    assert e.value.code == ErrorCode.INVALID_STRUCTURED_OUTPUT and e.value.param == "tools"
    assert ("json", schema(99).spec) not in m._cache
