"""What of a client's request reaches a replica: hop-by-hop headers and the client's credentials
(headers and query parameters) stay at the gateway; the replica gets the job's secret instead."""

from __future__ import annotations

import urllib.parse

from multidict import CIMultiDict

from ..keys import BATCH_OWNER

HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",  # RFC 9110 7.6.1
       "transfer-encoding", "upgrade", "host", "content-length", "expect",  # the body goes whole: no 100 Continue
       "content-encoding", "proxy-connection",   # (aiohttp has decoded a gzip'd body: the replica gets it plain)
       "accept-encoding"}   # a replica answers plain: the gateway reads its bodies (usage, SSE events, a resume)
CREDENTIAL_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "x-goog-api-key", "openai-organization",
                      "openai-project"}  # the client's credentials never reach a replica (it gets the job's secret)
CREDENTIAL_PARAMS = {"api_key", "api-key", "apikey", "key", "access_token", "token", "auth"}
ENGINE_CONTROL = {"x-vllm-priority"}  # vLLM takes it over the body's priority: the key's class decides that
GATEWAY_ONLY = {BATCH_OWNER}          # the batch runner's word to the gateway: whose line it is (a key's name)
HOP_BYTES = frozenset(h.encode() for h in HOP | CREDENTIAL_HEADERS | ENGINE_CONTROL | GATEWAY_ONLY) | {b"x-request-id"}


HOP_JSON = HOP_BYTES | {b"content-type"}   # (a JSON body's own Content-Type is the gateway's: JSON_TYPE)
JSON_TYPE = b"Content-Type: application/json\r\n"


def forwarded(raw: list[tuple[bytes, bytes]], json: bool = False) -> bytes:
    """The client's request header lines a replica gets: none of :data:`HOP_BYTES`, nor those its ``Connection``
    names (hop-by-hop too, RFC 9110 7.6.1).  ``json``: a body the gateway read as JSON goes as application/json,
    the one type vLLM reads (it answers 400 to none, or to application/*+json, which the gateway takes)."""
    base = HOP_JSON if json else HOP_BYTES
    out, named = [], None
    for kv in raw:   # (one pass: a request's every header, on the hot path)
        lk = kv[0].lower()
        if lk not in base:
            out.append(b"%s: %s\r\n" % kv)
        elif lk == b"connection":
            named = [*(named or ()), *(t.strip() for t in kv[1].lower().split(b","))]
    if named and not base.issuperset(named):   # (keep-alive names nothing more; another header name is dropped too)
        drop = base.union(named)
        out = [b"%s: %s\r\n" % kv for kv in raw if kv[0].lower() not in drop]
    return b"".join(out) + (JSON_TYPE if json else b"")


# a replica's response headers its client does not get: hop-by-hop (RFC 9110 7.6.1; Proxy-* too) and what the
# gateway's own server writes (its framing's Content-Length, Server, Date)
RESPONSE_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                          b"content-length", b"server", b"date"})


def end_to_end(raw: list[tuple[bytes, bytes]]) -> CIMultiDict:
    """A replica's end-to-end response headers (vLLM's bytes embeddings carry their layout and usage in
    ``metadata``) for its client, less the hop-by-hop ones and those its ``Connection`` names; what the gateway
    sets itself is set over them."""
    out: CIMultiDict = CIMultiDict()
    named = None
    for k, v in raw:
        lk = k.lower()
        if lk == b"connection":
            named = (named or set()) | {t.strip().decode("latin-1") for t in v.split(b",")}
        elif lk not in RESPONSE_HOP and lk[:6] != b"proxy-" and lk[:15] != b"access-control-":   # (CORS: the
            # gateway's own, gateway.cors_allowed_origins; a replica's would differ from its other paths')
            out.add(k.decode("latin-1"), v.decode("utf-8", "replace"))
    for name in named or ():
        out.popall(name, None)
    return out


def strip_credentials(target: str) -> str:
    """The request target without query parameters that carry credentials (``?api_key=...``)."""
    path, _, query = target.partition("?")
    kept = [kv for kv in query.split("&") if kv and urllib.parse.unquote_plus(kv.partition("=")[0]).lower()
            not in CREDENTIAL_PARAMS]
    return f"{path}?{'&'.join(kept)}" if kept else path
