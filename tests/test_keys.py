"""Keys and quotas for a shared server: named API keys (file or repeated flag) whose names are the tenants, per-key
requests/min, tokens/min and concurrency answered with 429 + Retry-After, CORS and TLS.

The limiter is tested with a hand-stepped clock; the server tests share one HTTPS server (a self-signed
certificate made here) with a key file of three keys, comparing counts of answers, never times."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from test_serving import MODEL, aengine, wait_kv_baseline  # noqa: F401  (aengine: a fixture)

from pdserve.api.api_keys import KeyLimits, KeyRing, default_name, parse_key_file
from pdserve.api.auth_and_body_limit import AuthAndBodyLimitMiddleware
from pdserve.api.errors import APIError
from pdserve.api.key_limiter import KeyLimiter, TokenQuota
from pdserve.api.protocol import CompletionRequest
from pdserve.cli import _list_arg
from pdserve.engine.client import EngineClient
from pdserve.launch import ServerProc, free_port, start_pdserve
from pdserve.server.serving import RequestContext
from pdserve.server.serving_completion import OpenAIServingCompletion

from conftest import hf_greedy


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _refused(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 429 and info.value.headers is not None
    return info.value


# ---- no server ----------------------------------------------------------------------------------------------------
def test_key_file_text_and_json() -> None:
    text = "# team keys\nalice:sk-a\n\nbob:sk-b:with:colons rpm=2 tpm=100 concurrent=1\n"
    alice, bob = parse_key_file(text)
    assert (alice.name, alice.key, alice.limits) == ("alice", b"sk-a", KeyLimits())
    assert (bob.name, bob.key) == ("bob", b"sk-b:with:colons")
    assert bob.limits == KeyLimits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=1)
    js = '{"keys": [{"name": "ci.bot", "key": "k1", "tokens_per_minute": 500}, {"name": "web", "key": "k2"}]}'
    bot, web = parse_key_file(js)
    assert bot.limits.tokens_per_minute == 500 and not web.limits.any
    assert [k.name for k in parse_key_file('[{"name": "x", "key": "y"}]')] == ["x"]


@pytest.mark.parametrize("text, says", [
    ("alice sk-a", "NAME:KEY"), ("al ice:k", "NAME:KEY"), ("租户:k", "key name"), ("a:k rps=3", "unknown limit"),
    ("a:k rpm=0", "positive"), ("a:", "non-empty"), ('{"keys": [{"name": "a", "key": "k", "rpm": 3}]}', "rpm"),
    ('{"keys": {"a": "k"}}', "expected"), ('{"keys": [{"name": "a", "key": "k", "max_concurrent": -1}]}', "positive"),
])
def test_key_file_errors_name_the_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_key_file(text, "keys.txt")


def test_key_ring_names_and_tenant_rule(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert KeyRing.from_options([], None) is None
    one = KeyRing.from_options(["sk-1"], None)
    assert one is not None and not one.pins_tenant  # one client: it picks tenants (X-Tenant) as before
    assert one.keys[0].name == default_name("sk-1") and "sk-1" not in default_name("sk-1")
    two = KeyRing.from_options(["sk-1", "sk-2"], None)
    assert two is not None and two.pins_tenant
    assert two.match(b"sk-2") is two.keys[1] and two.match(b"sk-3") is None and two.match(b"") is None
    path = tmp_path / "keys.txt"
    path.write_text("solo:sk-solo\n")
    path.chmod(0o600)
    filed = KeyRing.from_options([], str(path))
    assert filed is not None and filed.pins_tenant and "readable by other users" not in caplog.text
    path.chmod(0o644)
    KeyRing.from_options([], str(path))
    assert "readable by other users" in caplog.text
    with pytest.raises(ValueError, match="twice"):
        KeyRing.from_options(["sk-1", "sk-1"], None)
    path.write_text("a:k1\na:k2\n")
    with pytest.raises(ValueError, match="duplicate"):
        KeyRing.from_options([], str(path))


def test_requests_per_minute_and_concurrency_with_a_fake_clock() -> None:
    clock = FakeClock()
    (key,) = parse_key_file("bob:kb rpm=3 concurrent=2")
    lim = KeyLimiter([key], clock)
    lim.enter("bob")
    lim.enter("bob")
    e = _refused(lim.enter, "bob")  # two open: the concurrency limit, before requests/min is charged
    assert e.code == "concurrency_limit_exceeded" and e.headers == {"Retry-After": "1"}
    lim.leave("bob")
    lim.enter("bob")  # the third of the minute
    lim.leave("bob")
    lim.leave("bob")
    e = _refused(lim.enter, "bob")
    assert e.code == "rate_limit_exceeded" and e.type == "rate_limit_error"
    assert e.headers == {"Retry-After": "20"}  # one request refills in 60/3 s
    clock.t += 19.5
    _refused(lim.enter, "bob")
    clock.t += 0.5
    lim.enter("bob")
    assert lim.open_requests("bob") == 1
    lim.enter("alice")  # a key without limits is not tracked
    assert not lim.limits("alice") and lim.open_requests("alice") == 0


def test_tokens_per_minute_reserve_then_settle() -> None:
    clock = FakeClock()
    lim = KeyLimiter(parse_key_file("carol:kc tpm=120"), clock)
    assert lim.reserve_tokens("carol", 100) == 100  # prompt + max_tokens
    e = _refused(lim.reserve_tokens, "carol", 50)  # 20 left; 30 more refill at 2/s
    assert e.headers == {"Retry-After": "15"} and e.code == "rate_limit_exceeded"
    lim.settle_tokens("carol", 100, 30)  # it used 30: 70 come back
    assert lim.reserve_tokens("carol", 50) == 50
    # larger than a whole minute: waits for a full bucket, takes it, and the rest is settled as debt
    clock.t += 60
    assert lim.reserve_tokens("carol", 500) == 120
    lim.settle_tokens("carol", 120, 180)  # 60 over: the bucket is at -60
    clock.t += 60
    e = _refused(lim.reserve_tokens, "carol", 61)
    assert e.headers == {"Retry-After": "1"}
    assert lim.reserve_tokens("carol", 60) == 60
    assert lim.reserve_tokens("nobody", 10**9) == 0


def test_serving_reserves_then_settles_with_the_tokens_used(aengine: EngineClient, tiny_hf_model: Any,  # noqa: F811
                                                          tokenizer: Any) -> None:
    """Through the serving layer (no HTTP): a request reserves prompt + max_tokens, ends early on a stop token, and
    its key's bucket is then down by exactly the tokens it used; a request the bucket cannot cover is refused
    before it reaches the engine."""
    clock = FakeClock()  # never moves: no refill blurs the count
    lim = KeyLimiter(parse_key_file("carol:kc tpm=400"), clock)
    ctx = RequestContext(tenant="carol", quota=TokenQuota(lim, "carol"))
    prompt = "你好, world"
    greedy = hf_greedy(tiny_hf_model, tokenizer.encode(prompt), 3)
    serving = OpenAIServingCompletion(aengine, MODEL)
    body = CompletionRequest(prompt=prompt, max_tokens=200, temperature=0, stop_token_ids=[greedy[2]])
    resp = asyncio.run(serving.create_completion(body, ctx))
    assert isinstance(resp, dict) and resp["usage"]["completion_tokens"] <= 3
    bucket = lim._state["carol"].tokens
    assert bucket is not None and bucket.level == 400 - resp["usage"]["total_tokens"]
    body = CompletionRequest(prompt=prompt, max_tokens=400, ignore_eos=True)
    with pytest.raises(APIError) as info:  # prompt + max_tokens > what is left
        asyncio.run(serving.create_completion(body, ctx))
    assert info.value.status == 429 and info.value.headers is not None
    assert bucket.level == 400 - resp["usage"]["total_tokens"]  # a refusal costs nothing
    assert wait_kv_baseline(aengine).num_used_blocks == 0 and aengine.num_unfinished == 0


def test_middleware_holds_a_concurrency_slot_until_the_response_ends() -> None:
    """The key check and its limits in front of an app that answers only when told: dave's second request is
    refused while his first is open, alice (no limits) runs, the X-Tenant the app sees is the key's name."""
    release, seen = asyncio.Event(), []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope["headers"]).get(b"x-tenant"))
        if scope["path"] == "/v1/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    ring = KeyRing(parse_key_file("alice:ka\ndave:kd concurrent=1"), pins_tenant=True)
    guarded = AuthAndBodyLimitMiddleware(app, None, 1024, _NoMetrics(), keys=ring, limiter=KeyLimiter(ring.keys))

    async def run() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(guarded), base_url="http://t") as c:
            held = asyncio.create_task(c.get("/v1/slow", headers=_auth("kd", "alice")))
            while not seen:
                await asyncio.sleep(0)
            refused = await c.get("/v1/fast", headers=_auth("kd"))
            assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
            other = await c.get("/v1/fast", headers=_auth("ka"))
            release.set()
            first = await held
            again = await c.get("/v1/fast", headers=_auth("kd"))
            return [first.status_code, refused.status_code, other.status_code, again.status_code]

    assert asyncio.run(run()) == [200, 429, 200, 200]
    assert seen == [b"dave", b"alice", b"dave"]  # dave's own X-Tenant: alice was replaced


class _NoMetrics:
    def error(self, kind: str) -> None:
        pass


def test_list_args_as_vllm_or_commas() -> None:
    assert _list_arg('["*"]') == ["*"]
    assert _list_arg("http://a.example, https://b.example") == ["http://a.example", "https://b.example"]


# ---- one HTTPS server, three keys -----------------------------------------------------------------------------------
KEYS = "alice:sk-alice\nbob:sk-bob rpm=1\ncarol:sk-carol tpm=60\ndave:sk-dave rpm=2 concurrent=1\n"
ADMIN = "sk-admin"
ORIGIN = "https://app.example"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = tmp / "key.pem", tmp / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def verify(tls: tuple[Path, Path]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls[1]))  # trusts only the test's certificate


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, tls: tuple[Path, Path],
           verify: ssl.SSLContext) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("keys")
    (tmp / "keys.txt").write_text(KEYS)
    (tmp / "keys.txt").chmod(0o600)
    port = free_port()
    base = f"https://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(base + "/health", verify=verify, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    srv = start_pdserve(tmp, f"keys-{port}", [
        "serve", "--port", str(port), "--model", str(tiny_dir), "--dtype", "float32", "--num-kv-blocks", "128",
        "--max-model-len", "512", "--num-threads", "1", "--api-key-file", str(tmp / "keys.txt"),
        "--admin-api-key", ADMIN, "--allowed-origins", f'["{ORIGIN}"]', "--ssl-keyfile", str(tls[0]),
        "--ssl-certfile", str(tls[1]), "--device-peaks", "off"], base, healthy=healthy)  # no MFU checked here
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(scope="module")
def http(server: ServerProc, verify: ssl.SSLContext) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, verify=verify, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def kv_back_at_baseline(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each server test: no KV block used and no request open (refused requests leak nothing)."""
    http: httpx.Client | None = request.getfixturevalue("http") if "server" in request.fixturenames else None
    yield
    if http is None:
        return
    deadline = time.monotonic() + 10
    while (kv := http.get("/debug/kv", headers=_auth(ADMIN)).json())["num_used_blocks"] or kv["open_requests"]:
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def _auth(key: str, tenant: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"X-Tenant": tenant} if tenant else {})}


def _complete(http: httpx.Client, key: str, max_tokens: int = 2, tenant: str | None = None) -> httpx.Response:
    return http.post("/v1/completions", headers=_auth(key, tenant),
                     json={"prompt": "你好, world", "max_tokens": max_tokens, "ignore_eos": True})


def test_tls_with_the_openai_client(server: ServerProc, verify: ssl.SSLContext) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-alice", max_retries=0,
                           http_client=httpx.Client(verify=verify, timeout=120))
    r = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2
    with pytest.raises(httpx.ConnectError):  # the system's CAs do not know the test's certificate
        httpx.get(server.base_url + "/health")


def test_key_over_its_requests_per_minute_gets_429_while_the_other_runs(http: httpx.Client) -> None:
    answers: dict[str, list[httpx.Response]] = {"sk-alice": [], "sk-bob": []}
    for _ in range(4):  # interleaved: bob's one request of the minute, then refusals; alice is never refused
        for key in answers:
            answers[key].append(_complete(http, key))
    assert [r.status_code for r in answers["sk-alice"]] == [200] * 4
    assert [r.status_code for r in answers["sk-bob"]] == [200, 429, 429, 429]
    for r in answers["sk-bob"][1:]:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert http.post("/v1/completions", headers=_auth("sk-nobody"), json={}).status_code == 401
    metrics = http.get("/metrics", headers=_auth("sk-alice")).text  # the refusals count for bob's tenant
    assert 'pdserve:tenant_requests_total{model="unknown",status="429",tenant="bob"} 3.0' in metrics


def test_one_burst_over_quota_key_gets_429s_the_other_none(server: ServerProc, verify: ssl.SSLContext) -> None:
    """Both keys in one concurrent burst: dave (2 a minute, 1 at a time) gets 429s with Retry-After for all but
    the few his quota admits; alice (no limits) gets every answer. Counts only, no timing: at most 2 of dave's
    run within the minute, plus one the bucket may refill if the burst takes over 30 s."""
    async def burst() -> dict[str, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.base_url, verify=verify, timeout=120) as c:
            async def one(key: str) -> httpx.Response:
                return await c.post("/v1/completions", headers=_auth(key),
                                    json={"prompt": "你好, world", "max_tokens": 4, "ignore_eos": True})
            keys = ["sk-alice", "sk-dave"] * 8
            answers = await asyncio.gather(*[one(k) for k in keys])
        return {k: [r for kk, r in zip(keys, answers, strict=True) if kk == k] for k in ("sk-alice", "sk-dave")}

    got = asyncio.run(burst())
    assert [r.status_code for r in got["sk-alice"]] == [200] * 8
    dave = [r.status_code for r in got["sk-dave"]]
    assert set(dave) == {200, 429} and 1 <= dave.count(200) <= 3, dave
    for r in got["sk-dave"]:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"


def test_tokens_per_minute_and_concurrency(http: httpx.Client) -> None:
    first = _complete(http, "sk-carol", max_tokens=30)  # reserves prompt + 30 of carol's 60 a minute
    assert first.status_code == 200, first.text
    second = _complete(http, "sk-carol", max_tokens=30)
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
    assert "tokens per minute" in second.json()["error"]["message"] and int(second.headers["retry-after"]) >= 1
    assert first.json()["usage"]["total_tokens"] + 30 > 60  # so the second could not fit


def test_x_tenant_cannot_impersonate_another_key(http: httpx.Client) -> None:
    assert _complete(http, "sk-alice", tenant="mallory").status_code == 200
    assert _complete(http, ADMIN, tenant="ops").status_code == 200  # the admin key may name a tenant
    metrics = http.get("/metrics", headers=_auth("sk-alice")).text
    assert 'tenant="alice"' in metrics and 'tenant="ops"' in metrics
    assert 'tenant="mallory"' not in metrics


def test_cors_preflight_and_headers(http: httpx.Client) -> None:
    pre = http.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200  # answered before the key check: a preflight carries no key
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    other = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = http.get("/v1/models", headers={"Origin": ORIGIN, **_auth("sk-alice")})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    refused = http.get("/v1/models", headers={"Origin": ORIGIN})  # a browser can read the 401 too
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
