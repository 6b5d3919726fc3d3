"""The upload check of a batch line's ``body`` (orchestrator/batchbody.py, run by BatchLines): a body vLLM's request
model refuses is refused at upload, naming the line and the field, since one such line aborted a whole ``vllm
run-batch`` shard (retried, then every line of it ``shard_failed``).  The fidelity table's verdicts are checked
against vLLM 0.32's own validation, in one .venv-vllm subprocess, when .venv-vllm exists."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.batchcheck import BadLine, BatchLines

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**fields) -> dict:
    return {"model": "m", "messages": HI, **fields}


def with_(body: dict, **fields) -> dict:
    return {**body, **fields}


TABLE = [  # (accepted, url, body): the verdicts vLLM 0.32 gives (test_the_table_is_vllms_verdict)
    # /v1/chat/completions: ChatCompletionRequest
    (True, CHAT, chat()),
    (True, CHAT, chat(max_tokens="16", temperature="0.5", n=2, top_p=1, seed=-2 ** 63)),   # pydantic's lax types
    (True, CHAT, chat(logprobs=True, top_logprobs=5, stop=["a", "b", "c", "d"], max_completion_tokens=None)),
    (True, CHAT, chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})),
    (True, CHAT, chat(messages=[{"role": "system", "content": "be brief"}, *HI, {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42", "tool_call_id": "1"}], tools=TOOLS)),
    (True, CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                             {"type": "image_url", "image_url": {"url": "x"}}]}])),
    (True, CHAT, chat(my_own_field={"x": 1}, stream=False, stream_options={}, user="u")),   # unknown fields: ignored
    (True, CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}})),
    (True, CHAT, chat(messages=[])),
    (False, CHAT, chat(messages="hi")),
    (False, CHAT, {"model": "m", "prompt": "hi"}),
    (False, CHAT, chat(messages=[{"content": "hi"}])),
    (False, CHAT, chat(messages=[{"role": "user", "content": 5}])),
    (False, CHAT, chat(messages=[{"role": "user", "content": None}])),
    (False, CHAT, chat(messages=["hi"])),
    (False, CHAT, chat(max_tokens="x")),
    (False, CHAT, chat(max_tokens=1.5)),
    (False, CHAT, chat(n="two")),
    (False, CHAT, chat(temperature="hot")),
    (False, CHAT, chat(top_p={})),
    (False, CHAT, chat(top_k=0.5)),
    (False, CHAT, chat(presence_penalty="high")),
    (False, CHAT, chat(frequency_penalty=[1])),
    (False, CHAT, chat(stream_options={"include_usage": True})),
    (False, CHAT, chat(top_logprobs=5)),
    (False, CHAT, chat(logprobs="maybe")),
    (False, CHAT, chat(stop=["a", "b", "c", "d", "e"])),
    (False, CHAT, chat(seed=2 ** 63)),
    (False, CHAT, chat(tools=[])),
    (False, CHAT, chat(tool_choice="auto")),
    (False, CHAT, chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}})),
    (False, CHAT, chat(response_format={"type": "json_schema"})),
    (False, CHAT, chat(response_format={"type": "xml"})),
    (False, CHAT, chat(cache_salt="")),
    (False, CHAT, chat(continue_final_message=True, add_generation_prompt=True)),
    (False, CHAT, chat(reasoning_effort="huge")),
    # /v1/completions: CompletionRequest (run-batch serves no such endpoint: `vllm serve` validates it so)
    (True, COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 8, "echo": None}),
    (True, COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "logprobs": 2, "stop": "."}),
    (False, COMPLETIONS, {"model": "m", "max_tokens": 8}),
    (False, COMPLETIONS, {"model": "m", "prompt": [-1]}),
    (False, COMPLETIONS, {"model": "m", "prompt": "hi", "n": None}),
    (False, COMPLETIONS, {"model": "m", "prompt": "hi", "logprobs": "1"}),
    (False, COMPLETIONS, {"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}),
    (False, COMPLETIONS, {"model": "m", "prompt": "hi", "logprob_token_ids": [1]}),
    # /v1/embeddings: the EmbeddingRequest union (input, messages, a conversation as input, ...)
    (True, EMBEDDINGS, {"model": "m", "input": "hi"}),
    (True, EMBEDDINGS, {"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": "8"}),
    (True, EMBEDDINGS, {"model": "m", "input": [[1, 2], [3]]}),
    (True, EMBEDDINGS, {"model": "m", "messages": HI}),
    (True, EMBEDDINGS, {"model": "m", "input": HI}),
    (False, EMBEDDINGS, {"model": "m", "input": 5}),
    (False, EMBEDDINGS, {"model": "m"}),
    (False, EMBEDDINGS, {"model": "m", "input": ["a", 1]}),
    (False, EMBEDDINGS, {"model": "m", "input": "hi", "encoding_format": "hex"}),
    (False, EMBEDDINGS, {"model": "m", "input": "hi", "normalize": True}),
    (False, EMBEDDINGS, {"model": "m", "input": "hi", "dimensions": "x"}),
    (False, EMBEDDINGS, {"model": "m", "input": [{"role": "user", "content": 5}]}),
]


def request(url: str, body: dict, cid: str = "c") -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def upload(*lines: dict) -> None:
    """Check a file of ``lines`` as an upload does (model m served, any key)."""
    check = BatchLines(lambda name: name if name == "m" else None, None)
    check.feed(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    check.close()


def verdict(url: str, body: dict) -> bool:
    try:
        upload(request(url, body))
    except BadLine:
        return False
    return True


@pytest.mark.parametrize("accepted,url,body", TABLE, ids=[f"{u.rsplit('/', 1)[1]}-{i}" for i, (_, u, _) in
                                                         enumerate(TABLE)])
def test_the_upload_check_gives_the_tables_verdict(accepted, url, body):
    assert verdict(url, body) == accepted


VLLM_REF = """
import json, logging, sys, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from vllm.entrypoints.launchers.run_batch import BatchRequestInput
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
out = []
for line in json.load(sys.stdin):
    try:
        if json.loads(line)["url"] == "/v1/completions":   # what `vllm serve` validates a completion with
            CompletionRequest.model_validate(json.loads(line)["body"])
        else:                                               # what `vllm run-batch` does with each line
            BatchRequestInput.model_validate_json(line)
        out.append([True, ""])
    except Exception as exc:   # a ValidationError, vLLM's own VLLMValidationError, or a TypeError: all abort
        out.append([False, f"{type(exc).__name__}: {str(exc)[:300]}"])
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm (.ci/setup-vllm): the reference is vLLM's own "
                                                   "BatchRequestInput")
def test_the_table_is_vllms_verdict():
    lines = [json.dumps(request(url, body)) for _, url, body in TABLE]
    run = subprocess.run([str(VLLM_PY), "-c", VLLM_REF], input=json.dumps(lines), capture_output=True, text=True,
                         timeout=240, env={**os.environ, **ENV})
    results = [json.loads(ln.removeprefix("RESULT ")) for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and len(results) == 1, run.stderr[-3000:]
    mine = [verdict(url, body) for _, url, body in TABLE]
    differ = [(line, f"vLLM: {'accepts' if ok else 'refuses, ' + why}", f"slurmfleet: {'accepts' if m else 'refuses'}")
              for line, (ok, why), m in zip(lines, results[0], mine, strict=True) if ok != m]
    assert differ == []
    assert [ok for ok, _ in results[0]] == [accepted for accepted, _, _ in TABLE]


@pytest.mark.parametrize("url,body,words", [
    (CHAT, chat(max_tokens="x"), '`body.max_tokens` must be an integer or null, not "x".'),
    (CHAT, chat(messages="hi"), '`body.messages` must be a list of messages, not "hi".'),
    (CHAT, chat(messages=[*HI, {"role": "user", "content": 5}]), "`body.messages[1].content` must be a string or "
                                                                 "a list of content parts"),
    (CHAT, chat(messages=[*HI, {"content": "x"}]), "`body.messages[1].role` must be a string, not null."),
    (CHAT, {"model": "m"}, "`body.messages` is missing."),
    (CHAT, chat(stream_options={"include_usage": True}), "`body.stream_options` needs `stream: true`"),
    (CHAT, chat(top_logprobs=3), "`body.top_logprobs` needs `logprobs: true`."),
    (CHAT, chat(temperature="hot"), '`body.temperature` must be a number or null, not "hot".'),
    (CHAT, chat(tool_choice="required"), "`body.tool_choice` needs `tools`."),
    (CHAT, chat(stream="yes"), "`body.stream` must not be true"),   # vLLM's true too
    # vLLM's false, but the gateway (shared mode) takes only a boolean: every line failed there
    (CHAT, chat(stream=0), "`body.stream` must be false or absent, not 0."),
    (CHAT, chat(stream="false"), '`body.stream` must be false or absent, not "false".'),
    # run-batch (pydantic) refuses about 200 levels, failing the whole shard; the gateway 255
    (CHAT, chat(response_format=functools.reduce(lambda x, _: {"p": x}, range(140), {})), "nests more than 128 levels"),
    (COMPLETIONS, {"model": "m", "prompt": ""}, "`body.prompt` is missing or empty."),
    (EMBEDDINGS, {"model": "m", "input": 5}, "`body.input` must be a string, a list of strings"),
    (EMBEDDINGS, {"model": "m", "input": "x", "encoding_format": "hex"}, '`body.encoding_format` must be "float"'),
    # vLLM takes these, but answers in binary: the runner tried such a line 5 times (502), then an error line
    (EMBEDDINGS, {"model": "m", "input": "x", "encoding_format": "bytes"}, 'must be "float" or "base64" (vLLM'),
    (EMBEDDINGS, {"model": "m", "input": "x", "encoding_format": "bytes_only"}, 'must be "float" or "base64"'),
])
def test_a_body_vllm_refuses_is_a_bad_line_naming_the_line_and_the_field(url, body, words):
    good = [request(url, {"model": "m", "input": "a"} if url == EMBEDDINGS else {"model": "m", "prompt": "a"}
                    if url == COMPLETIONS else chat(), cid=f"c{i}") for i in range(3)]
    with pytest.raises(BadLine) as err:
        upload(*good, request(url, body, cid="bad"))
    assert err.value.line == 4
    assert str(err.value).startswith("Line 4: ") and words in str(err.value), str(err.value)


def test_a_long_value_is_shown_cut():
    with pytest.raises(BadLine) as err:
        upload(request(CHAT, chat(max_tokens="x" * 500)))
    assert str(err.value).endswith('not "' + "x" * 76 + '....'), str(err.value)
