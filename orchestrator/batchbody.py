"""A batch request's ``body`` checked as vLLM 0.32 validates it (:func:`check_body`, run by
:class:`orchestrator.batchcheck.BatchLines` at upload): ``vllm run-batch`` validates every line with its request
model before it runs any, and one it refuses aborts the run (the shard failed, was retried, loading the model each
time, and ended with every line ``shard_failed``).  Mirrored: vLLM 0.32's ``ChatCompletionRequest``, the
``EmbeddingRequest`` union, ``CompletionRequest`` (``vllm serve``'s for ``/v1/completions``): pydantic's lax types
(``"10"`` and ``true`` are integers, ``"yes"`` a boolean), the models' ``before`` validators (``stream_options``
without ``stream``, ...), unknown fields allowed (vLLM ignores them).  Plain functions over the parsed JSON.  Not
mirrored: a structural tag's grammar (accepted); the limits vLLM reads from its environment are their defaults
(``VLLM_MAX_STOP_STRINGS`` 4, ``VLLM_MAX_COMPLETION_PROMPTS`` 1024).  tests/test_batchcheck.py asks vLLM itself.
"""

from __future__ import annotations

import re

import orjson

I64, MAX_STOP, MAX_PROMPTS = 2 ** 63, 4, 1024
_INT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
LAX_FALSE, LAX_TRUE = ("0", "off", "f", "false", "n", "no"), ("1", "on", "t", "true", "y", "yes")
_NO = object()
_BOTH = "`body.continue_final_message` and `body.add_generation_prompt` cannot both be true."


class BadBody(ValueError):
    """What vLLM refuses in a body; the message names the field (``body.x``)."""


def show(v) -> str:
    text = orjson.dumps(v).decode()
    return text if len(text) <= 80 else text[:77] + "..."


# pydantic's lax scalars (python mode: vLLM validates the parsed JSON)

def as_int(v):   # v as pydantic's lax int reads it, else None
    t = type(v)
    if t is int or t is bool:
        return int(v)
    if t is float:
        return int(v) if v.is_integer() and -I64 <= v < I64 else None
    if t is str and _INT.fullmatch(s := v.strip()):
        return int(s.partition(".")[0])
    return None


def is_int(v) -> bool:
    return as_int(v) is not None


def is_float(v) -> bool:
    t = type(v)
    if t is str and v.isascii():
        try:
            float(v)
        except ValueError:
            return False
        return True
    return t is float or t is int or t is bool


def is_bool(v) -> bool:
    t = type(v)
    if t is int or t is float:
        return v == 0 or v == 1
    return t is bool or t is str and (v.lower() in LAX_TRUE or v.lower() in LAX_FALSE)


def _opt(check):
    return lambda v: v is None or check(v)


def _list(check):
    return lambda v: type(v) is list and all(map(check, v))


def _values(check):
    return lambda v: type(v) is dict and all(map(check, v.values()))


def _lit(*names):
    names = frozenset(names)
    return lambda v: type(v) is str and v in names


def _int_in(lo, hi=None):
    return lambda v: (i := as_int(v)) is not None and lo <= i and (hi is None or i <= hi)


def _has(**fields):   # an object whose fields pass their checks (a missing field is None, its default)
    return lambda v: type(v) is dict and all(check(v.get(k)) for k, check in fields.items())


is_str, is_dict = (lambda v: type(v) is str), (lambda v: type(v) is dict)
OPT_FLOAT, OPT_INT, OPT_BOOL, OPT_STR, OPT_DICT = (   # (the usual types first: a few microseconds a line in all)
    lambda v, t=t, check=check: type(v) is t or v is None or check(v)
    for t, check in ((float, is_float), (int, is_int), (bool, is_bool), (str, is_str), (dict, is_dict)))
INTS, STRS = _list(is_int), _list(is_str)
_FUNCTION = _has(name=is_str, description=OPT_STR, parameters=OPT_DICT, strict=OPT_BOOL, defer_loading=OPT_BOOL)
_JSON_SCHEMA = _has(name=is_str, description=OPT_STR, schema=OPT_DICT, strict=OPT_BOOL)
_STRUCTURED = _has(regex=OPT_STR, grammar=OPT_STR, whitespace_pattern=OPT_STR, structural_tag=OPT_STR,
                   choice=_opt(STRS), json_object=OPT_BOOL)


def _tool(v) -> bool:   # ChatCompletionToolsParam
    return (type(v) is dict and v.get("type", "function") == "function" and _FUNCTION(v.get("function", _NO))
            and OPT_BOOL(v.get("defer_loading")))


def _tool_choice(v) -> bool:
    return v is None or v in ("none", "auto", "required") or type(v) is dict and v.get(
        "type", "function") == "function" and _has(name=is_str)(v.get("function"))


def _response_format(v) -> bool:   # ResponseFormat (a structural tag's is not mirrored)
    kind = v.get("type") if type(v) is dict else None
    return kind == "structural_tag" or kind in ("text", "json_object", "json_schema") and _opt(_JSON_SCHEMA)(
        v.get("json_schema"))


def _structured(v) -> bool:   # StructuredOutputsParams, a dataclass whose __post_init__ wants one constraint
    kinds = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    return (type(v) is dict and sum(v.get(k) is not None for k in kinds) == 1 and _STRUCTURED(v)
            and (v.get("json") is None or type(v["json"]) in (str, dict))
            and is_bool(v.get("disable_any_whitespace", 0)) and is_bool(v.get("disable_additional_properties", 0)))


def _repetition(v) -> bool:   # RepetitionDetectionParams and its __post_init__
    hi, lo, count = (as_int(v.get(k, 0)) for k in ("max_pattern_size", "min_pattern_size", "min_count")) \
        if type(v) is dict else (None, None, None)
    return None not in (hi, lo, count) and 0 <= lo <= hi and (hi == 0 or count >= 2)


def _fields(spec: dict) -> dict:   # {"name1 name2": (description, check)} -> {name: (check, description)}
    return {name: (check, desc) for names, (desc, check) in spec.items() for name in names.split()}


_LOGPROBS = ("an integer or null", lambda v: v is None or type(v) in (int, float, bool) and is_int(v))
_SAMPLING = _fields({   # what ChatCompletionRequest and CompletionRequest share
    "frequency_penalty presence_penalty temperature top_p min_p repetition_penalty": ("a number or null", OPT_FLOAT),
    "length_penalty": ("a number", is_float),
    "logit_bias": ("an object of numbers or null", _opt(_values(is_float))),
    "max_tokens top_k": ("an integer or null", OPT_INT),
    "prompt_logprobs": _LOGPROBS,
    "seed": ("an integer in [-2**63, 2**63) or null", _opt(_int_in(-I64, I64 - 1))),
    "priority": ("an integer in [-2**63, 2**63)", _int_in(-I64, I64 - 1)),
    "stop": (f"a string, a list of at most {MAX_STOP} strings or null",
             lambda v: v is None or type(v) is str or STRS(v) and len(v) <= MAX_STOP),
    "stream watermarking return_tokens_as_token_ids return_token_ids return_token_offsets return_mm_kwargs":
        ("a boolean or null", OPT_BOOL),
    "stream_options": ("an object of booleans (include_usage, continuous_usage_stats) or null",
                       _opt(_has(include_usage=OPT_BOOL, continuous_usage_stats=OPT_BOOL))),
    "use_beam_search include_stop_str_in_output ignore_eos skip_special_tokens spaces_between_special_tokens "
    "add_special_tokens": ("a boolean", is_bool),
    "min_tokens": ("an integer", is_int),
    "routed_experts_prompt_start": ("an integer >= 0", _int_in(0)),
    "stream_interval": ("an integer >= 1 or null", _opt(_int_in(1))),
    "truncate_prompt_tokens": ("an integer >= -1 or null", _opt(_int_in(-1, I64 - 1))),
    "truncation_side": ('"left", "right" or null', _opt(_lit("left", "right"))),
    "stop_token_ids allowed_token_ids logprob_token_ids": ("a list of integers or null", _opt(INTS)),
    "bad_words": ("a list of strings", STRS),
    "model user session_id": ("a string or null", OPT_STR),
    "request_id": ("a string", is_str),
    "mm_payload": ('"tensors" or "none"', _lit("tensors", "none")),
    "kv_transfer_params ec_transfer_params": ("an object or null", OPT_DICT),
    "vllm_xargs": ("an object of strings, numbers or lists of them, or null", _opt(_values(lambda x: type(x) in (
        str, int, float, bool) or type(x) is list and all(type(y) in (str, int, float, bool) for y in x)))),
    "response_format": ('an object whose `type` is "text", "json_object" or "json_schema" (with a `json_schema` '
                        "that has a string `name`), or null", _opt(_response_format)),
    "structured_outputs": ("an object with exactly one of json, regex, choice, grammar, json_object and "
                           "structural_tag (of their types), or null", _opt(_structured)),
    "repetition_detection": ("an object of integers (0 <= min_pattern_size <= max_pattern_size; min_count >= 2 "
                             "unless max_pattern_size is 0) or null", _opt(_repetition)),
    "thinking_token_budget": ("an integer >= 0, -1 (unlimited) or null",
                              lambda v: v is None or type(v) is int and v >= -1),
})
CHAT = {**_SAMPLING, **_fields({
    "logprobs parallel_tool_calls": ("a boolean or null", OPT_BOOL),
    "max_completion_tokens n": ("an integer or null", OPT_INT),
    "top_logprobs": _LOGPROBS,
    "tools": ('a list of tools ({"type": "function", "function": {"name": ...}}) or null', _opt(_list(_tool))),
    "tool_choice": ('"none", "auto", "required", {"type": "function", "function": {"name": ...}} or null',
                    _tool_choice),
    "reasoning_effort": ('"none", "minimal", "low", "medium", "high", "xhigh", "max" or null',
                         _opt(_lit("none", "minimal", "low", "medium", "high", "xhigh", "max"))),
    "include_reasoning echo add_generation_prompt continue_final_message": ("a boolean", is_bool),
    "documents": ("a list of objects of strings or null", _opt(_list(_values(is_str)))),
    "chat_template": ("a string or null", OPT_STR),
    "chat_template_kwargs mm_processor_kwargs": ("an object or null", OPT_DICT),
    "media_io_kwargs": ("an object of objects or null", _opt(_values(is_dict))),
})}
COMPLETIONS = {**_SAMPLING, **_fields({
    "echo": ("a boolean or null", OPT_BOOL),
    "logprobs": _LOGPROBS,
    "n": ("an integer", is_int),
    "suffix": ("a string or null", OPT_STR),
    "prompt": ("a string, a list of strings, a list of token ids (integers >= 0), a list of such lists, or null",
               lambda v: v is None or type(v) is str or STRS(v) or _list(_int_in(0))(v) or _list(_list(_int_in(0)))(v)),
    "prompt_embeds": ("a string (base64), a list of them or null", lambda v: v is None or type(v) is str or STRS(v)),
})}
EMBEDDINGS = _fields({   # what every model of the EmbeddingRequest union has
    "model user": ("a string or null", OPT_STR),
    "truncate_prompt_tokens": ("an integer >= -1 or null", _opt(_int_in(-1))),
    "padding": ('"max_length", "do_not_pad" or null', _opt(_lit("max_length", "do_not_pad"))),
    "encoding_format": ('"float" or "base64" (vLLM answers "bytes" and "bytes_only" in binary, not a batch line)',
                        _lit("float", "base64")),
    "embed_dtype": ('"float32", "float16", "bfloat16", "fp8_e4m3" or "fp8_e5m2"',
                    _lit("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")),
    "endianness": ('"native", "big" or "little"', _lit("native", "big", "little")),
    "dimensions": ("an integer or null", OPT_INT),
    "use_activation": ("a boolean or null", OPT_BOOL),
})
EMBEDDINGS.update({k: CHAT[k] for k in ("truncation_side", "request_id", "priority", "mm_processor_kwargs",
                                        "add_special_tokens")})
_CONVERSATION = _list(lambda m: type(m) is dict and is_str(m.get("role")))   # vLLM's _is_chat_messages, if not []
CHAT_FORMS = {k: CHAT[k] for k in (   # the union's chat forms' own (its input form ignores them)
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "media_io_kwargs")}


# chat messages: vLLM takes a message that one of OpenAI's message params (by role), its own custom one (any
# string role) or Harmony's Message takes

def _tool_call(v, custom: bool = False) -> bool:   # OpenAI's function tool call param (or its custom one's)
    kind = v.get("type") if type(v) is dict and is_str(v.get("id")) else None
    if kind == "function":
        return _has(name=is_str, arguments=is_str)(v.get("function"))
    return custom and kind == "custom" and _has(name=is_str, input=is_str)(v.get("custom"))


def _function_tool(v) -> bool:   # OpenAI's ChatCompletionFunctionToolParam
    f = v.get("function") if type(v) is dict and v.get("type") == "function" else None
    return type(f) is dict and is_str(f.get("name")) and is_str(f.get("description", "")) and is_dict(
        f.get("parameters", {})) and OPT_BOOL(f.get("strict"))


def _custom(m: dict, calls) -> tuple[str, str] | None:
    """(field, what it must be) where vLLM's CustomChatCompletionMessageParam refuses ``m``, or None."""
    content, reasoning = m.get("content", ""), m.get("reasoning")
    if type(content) is not str and not _list(lambda p: type(p) in (str, dict))(content):
        return "content", "a string or a list of content parts (strings or objects)"
    if not is_str(m.get("name", "")):
        return "name", "a string"
    if calls is not None and not all(map(_tool_call, calls)):
        return "tool_calls", 'a list of tool calls ({"id", "type": "function", "function": {"name", "arguments"}})'
    if not _opt(_list(_function_tool))(m.get("tools")):
        return "tools", "a list of function tools or null"
    if reasoning is None and "reasoning_content" in m:   # vLLM renames it
        reasoning = m["reasoning_content"]
    for k, v in (("tool_call_id", m.get("tool_call_id")), ("reasoning", reasoning), ("task", m.get("task"))):
        if not OPT_STR(v):
            return k, "a string or null"
    return None


def _openai(m: dict, role: str, calls) -> bool:
    """Whether OpenAI's message param for ``role`` takes ``m`` (its content parts are Iterable: pydantic checks
    them lazily, when the request runs)."""
    content = m.get("content", _NO)
    iterable = type(content) in (str, list, dict)
    if role in ("user", "system", "developer", "assistant") and not is_str(m.get("name", "")):
        return False
    if role in ("user", "system", "developer"):
        return iterable
    if role == "tool":
        return iterable and is_str(m.get("tool_call_id"))
    if role == "function":
        return (content is None or type(content) is str) and is_str(m.get("name"))
    return role == "assistant" and (content is _NO or content is None or iterable) and OPT_STR(
        m.get("refusal")) and _opt(_has(id=is_str))(m.get("audio")) and _opt(_has(name=is_str, arguments=is_str))(
        m.get("function_call")) and ("tool_calls" not in m or calls is not None and all(
            _tool_call(c, True) for c in calls))


def _harmony(m: dict) -> bool:   # openai_harmony's Message
    author = m.get("author")
    role = author.get("role") if type(author) is dict else None
    return (type(role) is str and role in ("user", "assistant", "system", "developer", "tool")
            and OPT_STR(author.get("name")) and _list(is_dict)(m.get("content", []))
            and all(OPT_STR(m.get(k)) for k in ("channel", "recipient", "content_type")))


def _messages(v, field: str) -> None:
    if type(v) is not list:
        raise BadBody(f"`body.{field}` must be a list of messages, not {show(v)}.")
    for i, m in enumerate(v):
        role = m.get("role") if type(m) is dict else None
        if type(role) is str and len(m) == 2 and type(m.get("content")) is str:
            continue   # the usual message
        if type(m) is not dict:
            raise BadBody(f"`body.{field}[{i}]` must be an object, not {show(m)}.")
        why, calls = ("role", "a string"), m.get("tool_calls")
        if calls is not None and type(calls) is not list:
            if type(calls) is not str and type(calls) is not dict:   # vLLM's list() of it raises
                raise BadBody(f"`body.{field}[{i}].tool_calls` must be a list of tool calls, not {show(calls)}.")
            calls = list(calls)
        if type(role) is str and ((why := _custom(m, calls)) is None or _openai(m, role, calls)):
            continue
        if not ("author" in m and _harmony(m)):
            raise BadBody(f"`body.{field}[{i}].{why[0]}` must be {why[1]}, not {show(m.get(why[0]))}.")


# the checks of a whole body

def _types(body: dict, fields: dict) -> None:
    for k, v in body.items():
        if (rule := fields.get(k)) is not None and not rule[0](v):
            raise BadBody(f"`body.{k}` must be {rule[1]}, not {show(v)}.")


def _cache_salt(body: dict) -> None:
    salt = body.get("cache_salt")
    if salt is not None and (type(salt) is not str or not salt or len(salt) > 128 or any(
            c in salt for c in "@/\\\x00")):
        raise BadBody(f"`body.cache_salt` must be 1 to 128 characters but @, /, \\ and NUL, not {show(salt)}.")


def _logprobs(body: dict, names: tuple[str, str]) -> None:   # (after the types)
    for k in names:
        if (v := body.get(k)) is not None and v < 0 and v != -1:
            raise BadBody(f"`body.{k}` must be >= 0 or -1, not {show(v)}.")


def _sampling(body: dict, fields: dict) -> None:   # what CompletionRequest and ChatCompletionRequest both check
    _types(body, fields)
    _cache_salt(body)
    if body.get("stream_options") and not body.get("stream"):
        raise BadBody("`body.stream_options` needs `stream: true`, which a batch request does not use: leave it out.")
    rf = body.get("response_format")
    if type(rf) is dict and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise BadBody('`body.response_format` of type "json_schema" needs its `json_schema`.')
    if body.get("logprob_token_ids") and body.get("use_beam_search"):
        raise BadBody("`body.logprob_token_ids` cannot be used with `use_beam_search`.")


def _chat(body: dict) -> None:
    if "messages" not in body:
        raise BadBody("`body.messages` is missing.")
    _messages(body["messages"], "messages")
    _sampling(body, CHAT)
    _logprobs(body, ("prompt_logprobs", "top_logprobs"))
    if body.get("logprob_token_ids") and not body.get("logprobs"):
        raise BadBody("`body.logprob_token_ids` needs `logprobs: true`.")
    if (top := body.get("top_logprobs")) is not None and (top == -1 or top > 0) and not body.get("logprobs"):
        raise BadBody("`body.top_logprobs` needs `logprobs: true`.")
    so = body.get("structured_outputs")
    if so and any(so.get(k) is not None for k in ("json", "regex", "choice")) and body.get(
            "tool_choice", "none") not in ("none", "auto", "required"):
        raise BadBody("`body.structured_outputs` cannot be used with a named `tool_choice`.")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise BadBody(_BOTH)
    tools = body.get("tools")
    if tools == []:
        raise BadBody("`body.tools` must not be an empty list: leave it out.")
    choice = body["tool_choice"] if "tool_choice" in body else "auto" if tools else None
    if choice is None or choice == "none" or choice in ("auto", "required") and tools is not None:
        return
    if tools is None:
        raise BadBody("`body.tool_choice` needs `tools`.")
    name = choice["function"]["name"]   # (the types took it)
    if not name or not any(tool["function"]["name"] == name for tool in tools):
        raise BadBody(f"`body.tool_choice` names the function {show(name)}, which is none of `body.tools`.")


def _completions(body: dict) -> None:
    _sampling(body, COMPLETIONS)
    _logprobs(body, ("prompt_logprobs", "logprobs"))
    ids, echo, logprobs = body.get("logprob_token_ids"), body.get("echo"), body.get("logprobs")
    if body.get("use_beam_search") and echo and logprobs is not None:
        raise BadBody("`body.echo` with `logprobs` cannot be used with `use_beam_search`.")
    if ids and echo and body.get("max_tokens") == 0:
        raise BadBody("`body.logprob_token_ids` cannot be used with `echo` and `max_tokens: 0`.")
    if ids and logprobs is None:
        raise BadBody("`body.logprob_token_ids` needs `logprobs`.")
    prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        raise BadBody("`body.prompt` is missing or empty.")
    if type(prompt) is list and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
        raise BadBody(f"`body.prompt` is a list of {len(prompt)} prompts: at most {MAX_PROMPTS}.")
    if type(embeds) is list and len(embeds) > MAX_PROMPTS:
        raise BadBody(f"`body.prompt_embeds` is a list of {len(embeds)}: at most {MAX_PROMPTS}.")


def _embeddings(body: dict) -> None:
    if "normalize" in body:
        raise BadBody("`body.normalize` was removed from vLLM: use `use_activation`.")
    if body.get("task") in ("score", "encode"):
        raise BadBody(f"`body.task` {show(body['task'])} was removed from vLLM.")
    _cache_salt(body)
    if body.get("continue_final_message") and body.get("add_generation_prompt"):   # (the chat forms' validator:
        raise BadBody(_BOTH)                        # no pydantic error, it ends the whole union)
    _types(body, EMBEDDINGS)
    inp = body.get("input", _NO)
    if type(inp) is str or STRS(inp) or INTS(inp) or _list(INTS)(inp):
        return
    _types(body, CHAT_FORMS)   # a chat form: messages, or a conversation (or several) as input
    if "messages" in body:
        field, convs = "messages", body["messages"]
    elif inp and _CONVERSATION(inp) or type(inp) is list and inp and all(c and _CONVERSATION(c) for c in inp):
        field, convs = "input", inp
    elif inp is _NO:
        raise BadBody("`body.input` is missing.")
    else:
        raise BadBody("`body.input` must be a string, a list of strings, a list of token ids (integers), a list of "
                      f"such lists, or a conversation (a list of messages), not {show(inp)}.")
    if type(convs) is list and convs and all(type(c) is list and c for c in convs):
        for i, conv in enumerate(convs):   # several conversations
            _messages(conv, f"{field}[{i}]")
    else:
        _messages(convs, field)


CHECKS = {"/v1/chat/completions": _chat, "/v1/completions": _completions, "/v1/embeddings": _embeddings}


def check_body(url: str, body: dict) -> None:
    """Raises :class:`BadBody` if vLLM 0.32 refuses ``body`` for ``url`` (an endpoint without a check: none)."""
    if (check := CHECKS.get(url)) is not None:
        check(body)
