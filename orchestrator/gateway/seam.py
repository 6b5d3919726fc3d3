"""Where a continuation starts when the last event before a cut carried several tokens.

vLLM holds back the text of a token that ends in the middle of a character (an emoji's or a CJK character's
bytes) until the token that completes it, and merges a request's outputs into one event when its API server
falls behind (several token ids, the text of those that ended whole).  After a cut right behind such an event
the gateway cannot tell from the event alone whether its last ids are half a character, and a continuation
prompt that ends in half a character makes vLLM's detokenizer answer with the prompt's text.

So before such a continuation is sent, the replica that takes it (the same engine, so the same tokenizer)
decodes the event's ids with a few before them (vLLM's ``/detokenize``): text that ends in U+FFFD ends mid-
character, and the trailing ids that make it go back to the engine to be made again (:attr:`.Stitch.back`).
An engine that cannot answer (no ``/detokenize``, an error, too slow) leaves the cut where it was, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .enginecall import call_engine

if TYPE_CHECKING:
    from .pool import Lease
    from .server import Gateway
    from .stitch import Stitch

log = logging.getLogger(__name__)

CONTEXT = 8        # ids decoded before the event's, so that its first ones are read as part of whole characters
MAX_BACK = 4       # a UTF-8 character is at most 4 bytes: at most that many byte tokens end half of one
TIMEOUT_S = 2.0    # per decode; a replica that takes longer is not asked again for this cut
REPLACEMENT = "\ufffd"


async def settle(gw: "Gateway", lease: "Lease", st: "Stitch", model: str, rid: str) -> None:
    """Set ``st.back``: how many of the generated ids, at the end, are half a character (0 when none is, when
    the last event carried one token, or when the replica cannot say)."""
    st.back = 0
    n = st.merged
    if n < 2 or len(st.ids) < n:
        return
    window = st.ids[-(n + CONTEXT):]
    try:
        for k in range(0, min(n - 1, MAX_BACK) + 1):
            text = await _detokenize(gw, lease, model, window[:len(window) - k], rid)
            if text is None:
                return
            if not text.endswith(REPLACEMENT):
                st.back = k
                return
    except Exception as exc:  # noqa: BLE001 - whatever the replica answered, the cut stays where it was
        log.info("replica %s/%s could not decode a continuation's last tokens (%s): the cut stays",
                 model, lease.slot.label, exc)
    # every shorter window still ends mid-character: not vLLM's held text; the cut stays where it was


async def _detokenize(gw: "Gateway", lease: "Lease", model: str, ids: list[int], rid: str) -> str | None:
    """The replica's text for ``ids`` (None: it does not decode them)."""
    _, data = await call_engine(gw.upstream, lease.slot, "/detokenize", {"model": model, "tokens": ids}, TIMEOUT_S, rid)
    text = data.get("prompt") if isinstance(data, dict) else None
    return text if isinstance(text, str) else None
