"""Browsers calling the gateway from another origin (``gateway.cors_allowed_origins``): preflights, the headers
on every kind of answer (proxied, streamed, the gateway's own, its refusals), a replica's own CORS headers never
passed on, a reload that turns it on, and a bad origin's positioned error."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from gateway_harness import Harness
from orchestrator.fleetfile import load_config_text
from orchestrator.yamlsrc import ConfigError
from test_gateway_edges import COMPLETION, MODELS, engines, post

PAGE = "https://chat.example.org"
KEY = {"Authorization": "Bearer sk-bob"}
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


async def engine_with_its_own_cors(request: web.Request) -> web.StreamResponse:
    """An engine started with ``--allowed-origins '["*"]'``: its answers say any page may read them."""
    own = {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Credentials": "true"}
    if json.loads(await request.read()).get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **own})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n')
        return resp
    return web.json_response(COMPLETION, headers=own)


@pytest.fixture
def gw(tmp_path):
    made: list[Harness] = []

    def make(gateway: str = "") -> Harness:
        h = Harness(tmp_path, MODELS, "shutdown_grace_s: 1\napi_keys: [sk-bob]\n" + gateway)
        made.append(h)
        engines(h, engine_with_its_own_cors)
        return h
    yield make
    for h in made:
        h.close()


def preflight(h: Harness, origin: str, path: str = "/v1/chat/completions"):
    return post(h, b"", {"Origin": origin, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"},
                path=path, method="OPTIONS")


def lower(headers: dict) -> dict:
    return {k.lower(): v for k, v in headers.items()}


def test_off_by_default_and_a_replicas_own_cors_headers_never_reach_the_client(gw):
    h = gw()
    status, headers, _ = preflight(h, PAGE)
    assert status == 405 and "access-control-allow-origin" not in lower(headers)
    for body in (CHAT, CHAT.replace(b'"max_tokens"', b'"stream": true, "max_tokens"')):
        status, headers, data = post(h, body, {**KEY, "Origin": PAGE}, path="/v1/chat/completions")
        assert status == 200 and data
        assert not [k for k in lower(headers) if k.startswith("access-control-")], headers


def test_an_allowed_page_gets_its_preflight_and_reads_every_answer(gw):
    h = gw(f"cors_allowed_origins: [{PAGE.upper().replace('HTTPS', 'https')}]")   # (compared as browsers send it)
    status, headers, data = preflight(h, PAGE)   # no key: browsers send none on a preflight
    headers = lower(headers)
    assert status == 204 and not data
    assert headers["access-control-allow-origin"] == PAGE and headers["vary"] == "Origin"
    assert headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    assert "POST" in headers["access-control-allow-methods"] and int(headers["access-control-max-age"]) > 0
    status, headers, data = preflight(h, "https://evil.example.com")
    assert status == 403 and json.loads(data)["error"]["code"] == "cors_origin_not_allowed"
    assert "access-control-allow-origin" not in lower(headers)

    page = {**KEY, "Origin": PAGE, "x-request-id": "r-1"}
    for body in (CHAT, CHAT.replace(b'"max_tokens"', b'"stream": true, "max_tokens"')):   # plain, then streamed
        status, headers, data = post(h, body, page, path="/v1/chat/completions")
        headers = lower(headers)
        assert status == 200 and data
        assert headers["access-control-allow-origin"] == PAGE   # the gateway's, not the engine's "*"
        assert "access-control-allow-credentials" not in headers
        assert "x-request-id" in headers["access-control-expose-headers"] and headers["x-request-id"] == "r-1"
        assert "Origin" in headers["vary"]
    status, headers, _ = post(h, b"", {"Origin": PAGE}, path="/v1/models", method="GET")   # its own, keyless: 401
    assert status == 401 and lower(headers)["access-control-allow-origin"] == PAGE   # (the page can read why)
    status, headers, _ = post(h, b"", {**KEY, "Origin": PAGE}, path="/v1/models", method="GET")
    assert status == 200 and lower(headers)["access-control-allow-origin"] == PAGE
    status, headers, _ = post(h, CHAT, {**KEY, "Origin": "https://evil.example.com"}, path="/v1/chat/completions")
    assert status == 200 and "access-control-allow-origin" not in lower(headers)   # (the browser keeps it from the page)
    # every answer varies by Origin (one without it, or another page's, must not be served from a cache to this one)
    assert "Origin" in lower(headers)["vary"]
    status, headers, _ = post(h, b"", KEY, path="/v1/models", method="GET")
    assert status == 200 and lower(headers)["vary"] == "Origin"


def test_any_origin_and_a_reload_that_turns_it_on(gw):
    h = gw()
    assert preflight(h, PAGE)[0] == 405
    h.reload(h.text.replace("  api_keys: [sk-bob]\n", "  api_keys: [sk-bob]\n  cors_allowed_origins: ['*']\n"))
    status, headers, _ = preflight(h, "http://localhost:3000")
    assert status == 204 and lower(headers)["access-control-allow-origin"] == "*" and "vary" not in lower(headers)
    status, headers, _ = post(h, CHAT, {**KEY, "Origin": "http://localhost:3000"}, path="/v1/chat/completions")
    assert status == 200 and lower(headers)["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("origin", ["https://chat.example.org/", "chat.example.org", "https://chat.example.org/app"])
def test_an_origin_that_is_not_one_is_a_positioned_error(origin):
    text = f"fleet: f\nstate_dir: /tmp/sf-cors\ngateway:\n  cors_allowed_origins:\n    - {origin}\nmodels: []\n"
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "fleet.yaml", {})
    msg = str(info.value)
    assert "fleet.yaml" in msg and "cors_allowed_origins" in msg and "not an origin" in msg, msg
