"""The gateway's own calls to a replica's engine (not a client's request): a JSON body to one of vLLM's
endpoints (``/tokenize``, ``/detokenize``), over the pooled upstream connections, with the replica's secret."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from .pool import Slot
    from .upstream import Upstream


async def call_engine(upstream: "Upstream", slot: "Slot", path: str, body: dict | None, timeout_s: float,
                      rid: str = "") -> tuple[int, object]:
    """POST ``body`` (None: GET) to ``path`` of the slot's engine within ``timeout_s``: (status, its JSON answer,
    None unless 200).  Raises as :meth:`~.upstream.Upstream.request` (and ValueError for an answer that is no
    JSON)."""
    raw = b"" if body is None else orjson.dumps(body)
    ep = slot.replica.endpoint
    head = (f"GET {path} HTTP/1.1\r\n" if body is None else f"POST {path} HTTP/1.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(raw)}\r\n").encode() + (
        f"x-request-id: {rid}\r\n" if rid else "").encode() + slot.tail()
    resp = await upstream.request(ep.host, ep.port, head, raw, first_byte_timeout_s=timeout_s,
                                  total_timeout_s=timeout_s)
    try:
        data = orjson.loads(await resp.read()) if resp.status == 200 else None
    except BaseException:
        resp.close()   # (cancelled at shutdown too: its connection is not left to the sweeper, gone by then)
        raise
    resp.release()
    return resp.status, data
