"""Chat messages and tools normalised the way vLLM's OpenAI server parses them before its chat template
renders them (text parts, tool-call arguments, the ``developer`` role): the part of
:mod:`orchestrator.prompttokens` that follows vLLM's request parsing rather than the tokenizer."""

from __future__ import annotations

import json
from typing import Any

TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}
BILLING_HEADER = "x-anthropic-billing-header"  # per-request line vLLM drops from system text parts


def _part_text(part: Any) -> tuple[str, str | None]:
    """(kind, text) of one content part: kind "text" or "tool_reference"; text None means skip it."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise ValueError(f"content part must be a string or an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind in TEXT_PART_KEYS:
        text = part.get(TEXT_PART_KEYS[kind])
        if text is not None and not isinstance(text, str):
            raise ValueError(f"content part of type {kind!r} must hold a string")
        return "text", text
    if kind == "tool_reference":
        return "tool_reference", part.get("name")
    raise ValueError(f"content part of type {kind!r} is not text: only text prompts can be tokenized here")


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop the per-request attribution line some clients put at the top of system text, as vLLM does."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) \
            and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _arguments(value: Any) -> dict:
    """Tool-call arguments as the dict templates expect (vLLM parses the JSON string, else ``{}``)."""
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def message(msg: Any, parts_format: bool) -> dict:
    """One request message as vLLM hands it to the chat template."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError("each message must be an object with a string 'role'")
    role, content = msg["role"], msg.get("content")
    parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ValueError(f"message content must be a string, a list of parts or null, got {type(content).__name__}")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts = [(kind, text) for kind, text in map(_part_text, parts) if text is not None]
    out: dict[str, Any] = {"role": role}
    if parts_format:
        out["content"] = [{"type": "text", "text": t} if k == "text" else {"type": k, "name": t} for k, t in texts]
    else:   # (vLLM drops empty parts before joining: a falsy part is no part)
        out["content"] = "\n".join(t for _, t in texts if t)
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = list(msg["tool_calls"])
        if msg.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = msg["reasoning"]
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(out["content"], list) and all(p["type"] == "text" for p in out["content"]):
            out["content"] = "\n".join(p["text"] for p in out["content"])
    for key in ("name", "task"):
        if isinstance(msg.get(key), str):
            out[key] = msg[key]
    if role == "developer":
        tools = msg.get("tools")
        out["tools"] = [_ordered(t, ("function", "type")) if isinstance(t, dict) else t for t in tools] \
            if isinstance(tools, list) else tools
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        if not calls:
            del out["tool_calls"]
        for i, call in enumerate(calls):
            if not isinstance(call, dict) or call.get("type", "function") != "function" \
                    or not isinstance(call.get("function"), dict):
                raise ValueError("assistant tool_calls entries must be objects of type 'function'")
            fn = _ordered(call["function"], ("arguments", "name"))
            calls[i] = _ordered(call, ("id", "function", "type")) | {"function": fn}
            fn["arguments"] = _arguments(fn.get("arguments"))
    return out


def _ordered(d: dict, keys: tuple[str, ...]) -> dict:
    """A copy of ``d`` with ``keys`` first, in that order, then the rest: the key order vLLM's request
    validation gives typed objects (it shows wherever a template prints one with ``tojson``)."""
    return {k: d[k] for k in keys if k in d} | {k: v for k, v in d.items() if k not in keys}


def developer_as_system(conv: list[dict]) -> list[dict]:
    """For templates without a ``developer`` role: make those ``system`` and merge all system text first."""
    conv = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
            for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if not systems or systems == [0]:
        return conv
    texts = []
    for i in systems:
        content = conv[i].get("content") or ""
        if isinstance(content, list):
            content = "\n".join(p if isinstance(p, str) else p["text"] for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}] + [m for m in conv if m["role"] != "system"]


def tool(tool: Any) -> dict:
    """A request tool as vLLM's request model dumps it (``description``/``parameters`` always present)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict) \
            or not isinstance(tool["function"].get("name"), str):
        raise ValueError("each tool must be an object with a 'function' holding a string 'name'")
    fn = tool["function"]
    out_fn = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    defer = fn.get("defer_loading", tool.get("defer_loading"))
    out_fn |= {k: v for k, v in (("strict", fn.get("strict")), ("defer_loading", defer)) if v is not None}
    out = {"type": tool.get("type", "function"), "function": out_fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def messages_api_system(body: dict) -> list[dict]:
    """A ``/v1/messages`` (Anthropic) body's top-level ``system`` as vLLM turns it into the chat's leading system
    message: a string, or its text blocks joined (Claude Code's per-request billing header left out); [] without
    one.  ``ValueError`` for what vLLM may render otherwise: an inline system message (merged into the leading one
    or not, as the chat template needs) and Anthropic tools (converted to OpenAI's functions)."""
    system = body.get("system")
    if any(isinstance(m, dict) and m.get("role") == "system" for m in body.get("messages") or ()):
        raise ValueError("a Messages request with an inline system message")
    if any(isinstance(t, dict) and "input_schema" in t for t in body.get("tools") or ()):
        raise ValueError("a Messages request's tools")
    if not system:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list) or not all(isinstance(b, dict) for b in system):
        raise ValueError("'system' must be a string or a list of blocks")
    text = "".join(b["text"] for b in system if b.get("type") == "text" and isinstance(b.get("text"), str) and
                   b["text"] and not b["text"].startswith(BILLING_HEADER))
    return [{"role": "system", "content": text}] if text else []
