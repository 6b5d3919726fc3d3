"""What a reload changes beyond the models (their lines come from :func:`~orchestrator.fleet.planner.reload_changes`):
the settings of each other section by name, and the client keys by count.  No value is shown: a key is a secret,
and a line names a key by its name only."""

from __future__ import annotations

from .config import FleetConfig

SECTIONS = ("gateway", "daemon", "batches", "cluster")
KEY_FIELDS = {"api_keys", "api_keys_file"}   # (said as keys added and revoked, not as fields)


def settings_changes(old: FleetConfig, new: FleetConfig) -> list[str]:
    out = []
    for section in SECTIONS:
        a, b = getattr(old, section), getattr(new, section)
        fields = [f for f in type(b).model_fields if f not in KEY_FIELDS and getattr(a, f) != getattr(b, f)]
        if fields:
            out.append(f"{section}: {', '.join(fields)} changed")
    before = {k.digest: k for k in old.gateway.keys()}
    after = {k.digest: k for k in new.gateway.keys()}
    added = sorted(after[d].name for d in after.keys() - before)
    revoked = sorted(before[d].name for d in before.keys() - after)
    changed = sorted(after[d].name for d in after.keys() & before.keys() if after[d] != before[d])   # (limits, ...)
    if added or revoked or changed:
        out.append("client keys: " + "; ".join(f"{len(names)} {what} ({', '.join(names)})" for what, names in (
            ("added", added), ("revoked", revoked), ("changed", changed)) if names))
    elif old.gateway.open != new.gateway.open:
        out.append("client keys: " + ("none asked now (open)" if new.gateway.open else "asked now"))
    return out
