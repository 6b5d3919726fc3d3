"""PromptTokenizer: the prompt ids vLLM computes, from the model's tokenizer.json and chat template alone.

The important checks compare with the real thing in .venv-vllm: transformers' AutoTokenizer and
apply_chat_template (skipped without .venv-vllm), and, marked ``vllm``, vLLM's own chat/completion renderer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from orchestrator.devtools.tinymodel import build_tokenizer
from orchestrator.prompttokens import PromptTokenizer

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
TINY_LLAMA = Path(os.environ.get("SLURMFLEET_MODEL_DIR", "/tmp/slurmfleet-models/tiny-llama"))
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"}

# A template in the style of real tool-using models: loops over content parts (so vLLM passes them as a
# list), prints tools with tojson, renders tool calls, rejects unknown roles, knows no "developer" role.
RICH_TEMPLATE = """{{ bos_token }}{% if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}
{% if message.tool_calls is defined %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}
<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"""

SYSTEM_USER = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Say hi."}]
MULTI_TURN = SYSTEM_USER + [{"role": "assistant", "content": "Hi."},
                            {"role": "user", "content": "Again, ünïcode ✓"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}}]

# bodies whose vLLM handling transformers' apply_chat_template reproduces on the raw messages
PLAIN_CASES = [
    (True, {"messages": SYSTEM_USER}),
    (True, {"messages": MULTI_TURN}),
    (True, {"messages": MULTI_TURN, "add_generation_prompt": False}),
    (True, {"messages": SYSTEM_USER + [{"role": "assistant", "content": "Hello, I am"}],
            "add_generation_prompt": False, "continue_final_message": True}),
    (True, {"messages": [{"role": "user", "content": "x" * 300 + " end"}], "add_special_tokens": True}),
    (False, {"prompt": "def build_tokenizer(out: Path) -> Path:"}),
    (False, {"prompt": "  leading spaces and\nnewlines\t"}),
    (False, {"prompt": "no specials", "add_special_tokens": False}),
]
# bodies that need vLLM's own message parsing (parts, developer role, tool-call arguments, kwargs)
VLLM_CASES = PLAIN_CASES + [
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, "two",
                                                      {"type": "text", "text": "three"}]}]}),
    (True, {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "Sys."},
                         {"role": "user", "content": "q"}]}),
    (True, {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "12C"}]}],
            "tools": TOOLS}),
    (True, {"messages": [{"role": "user", "content": "again", "name": "bob"},
                         {"role": "assistant", "content": "ok", "reasoning": "hm", "tool_calls": [
                             {"function": {"name": "get_weather", "arguments": '{"city":"Bergen"}'}, "type": "function",
                              "id": "c2"}]},
                         {"role": "tool", "tool_call_id": "c2", "content": "9C"}]}),
    (True, {"messages": SYSTEM_USER, "reasoning_effort": "none"}),
    (True, {"messages": SYSTEM_USER, "chat_template_kwargs": {"enable_thinking": False, "unused": 1}}),
    (True, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                              "content": [{"type": "text", "text": "Sure, "}]}],
            "add_generation_prompt": False, "continue_final_message": True}),
    (False, {"prompt": [[11, 12, 13]]}),
    (False, {"prompt": ["a single prompt in a list"]}),
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": ""},   # (an empty part: no part)
                                                      {"type": "text", "text": "hello there"}]}]}),
]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def variant(tokdir: Path, dest: Path, template: str | None = None, **config) -> Path:
    """A copy of the tokenizer directory with another chat template and/or tokenizer_config entries."""
    shutil.copytree(tokdir, dest)
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)
    cfg = json.loads((dest / "tokenizer_config.json").read_text()) | config
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def richdir(tokdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return variant(tokdir, tmp_path_factory.mktemp("rich") / "m", RICH_TEMPLATE)


@pytest.fixture(scope="module")
def bosdir(tokdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-style tokenizer: its tokenizer.json post-processor puts BOS before plain text."""
    out = variant(tokdir, tmp_path_factory.mktemp("bos") / "m")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|>:0 $A:0", pair="<|endoftext|>:0 $A:0 <|endoftext|>:1 $B:1",
        special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    tok.save(str(out / "tokenizer.json"))
    return out


def test_tokenizer_only_cli_builds_a_loadable_directory(tmp_path: Path) -> None:
    out = tmp_path / "m"
    for expected in ("tokenizer built", "tokenizer already built"):
        run = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "orchestrator.devtools.tinymodel",
                              "--tokenizer-only", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert expected in run.stdout
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    tok = PromptTokenizer.from_dir(out)
    assert tok.vocab_size == 2048 and tok.has_chat_template
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


def test_chat_prompt_is_the_rendered_template(tokdir: Path) -> None:
    tok = PromptTokenizer.from_dir(tokdir)
    text = tok.render_chat({"messages": SYSTEM_USER})
    assert text == ("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
                    "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.prompt_ids({"messages": SYSTEM_USER}, chat=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids[0] == tok.encode("<|im_start|>", False)[0] and len(tok.encode("<|im_start|>", False)) == 1
    no_prompt = tok.prompt_ids({"messages": SYSTEM_USER, "add_generation_prompt": False}, chat=True)
    assert ids[:len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)
    cont = tok.render_chat({"messages": SYSTEM_USER + [{"role": "assistant", "content": "Hello, I am"}],
                            "add_generation_prompt": False, "continue_final_message": True})
    assert cont.endswith("<|im_start|>assistant\nHello, I am")


def test_content_parts_follow_the_template_format(tokdir: Path, richdir: Path) -> None:
    parts = [{"type": "text", "text": "one"}, "two", {"type": "text", "text": None}]  # a None text is skipped
    body = {"messages": [{"role": "user", "content": parts}]}
    # a template printing message['content'] gets the text parts joined by newlines...
    assert "user\none\ntwo<|im_end|>" in PromptTokenizer.from_dir(tokdir).render_chat(body)
    # ...one looping over the content gets them as parts
    assert "user\nonetwo<|im_end|>" in PromptTokenizer.from_dir(richdir).render_chat(body)


def test_tool_calls_are_shaped_as_vllm_passes_them(richdir: Path) -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}, "id": "c1"}
    body = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]}], "tools": TOOLS}
    text = PromptTokenizer.from_dir(richdir).render_chat(body)
    # arguments parsed to an object; keys in the order vLLM's request validation leaves them
    assert '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>' in text
    # tools as vLLM's request model dumps them
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", ' in text
    assert call["function"]["arguments"] == "{\"city\": \"Oslo\"}"  # the request body is left alone


def test_a_prompt_longer_than_max_chars_is_not_tokenized(tokdir: Path) -> None:
    """Tokenizing runs on the gateway's event loop: an 8 MB prompt held every stream of that process for 13 s
    (the engine refuses such a prompt anyway); past ``max_chars`` it is untokenizable, routed without keys."""
    tok = PromptTokenizer.from_dir(tokdir)
    tok.max_chars = 1000
    assert tok.prompt_ids({"prompt": "x" * 1000}, chat=False)
    with pytest.raises(ValueError, match="characters are more than the 1000"):
        tok.prompt_ids({"prompt": "x" * 1001}, chat=False)
    with pytest.raises(ValueError, match="characters are more than the 1000"):
        tok.prompt_ids({"messages": [{"role": "user", "content": "x" * 1001}]}, chat=True)


def test_completion_prompts(tokdir: Path, bosdir: Path) -> None:
    tok = PromptTokenizer.from_dir(tokdir)
    text_ids = tok.encode("hello world")
    assert tok.prompt_ids({"prompt": "hello world"}, chat=False) == text_ids
    assert tok.prompt_ids({"prompt": ["hello world"]}, chat=False) == text_ids
    assert tok.prompt_ids({"prompt": [7, 8, 9]}, chat=False) == [7, 8, 9]
    assert tok.prompt_ids({"prompt": [[7, 8, 9]]}, chat=False) == [7, 8, 9]
    # a tokenizer that adds BOS: completions get it by default, chat only when asked
    bos = PromptTokenizer.from_dir(bosdir)
    bos_id = bos.encode("<|endoftext|>", False)
    assert bos.prompt_ids({"prompt": "hello world"}, chat=False) == bos_id + text_ids
    assert bos.prompt_ids({"prompt": "hello world", "add_special_tokens": False}, chat=False) == text_ids
    chat = tok.prompt_ids({"messages": SYSTEM_USER}, chat=True)
    assert bos.prompt_ids({"messages": SYSTEM_USER}, chat=True) == chat
    assert bos.prompt_ids({"messages": SYSTEM_USER, "add_special_tokens": True}, chat=True) == bos_id + chat


@pytest.mark.parametrize("chat, body, message", [
    (True, {}, "'messages' must be a non-empty list"),
    (True, {"messages": []}, "'messages' must be a non-empty list"),
    (True, {"messages": [{"content": "no role"}]}, "string 'role'"),
    (True, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "'image_url' is not text"),
    (True, {"messages": SYSTEM_USER, "continue_final_message": True}, "cannot set both"),
    (True, {"messages": SYSTEM_USER, "chat_template": "{{ messages }}"}, "request-supplied 'chat_template'"),
    (True, {"messages": SYSTEM_USER, "chat_template_kwargs": {"tokenize": True}}, "unsupported chat_template_kwargs"),
    (True, {"messages": SYSTEM_USER, "truncate_prompt_tokens": 5}, "'truncate_prompt_tokens' is not supported"),
    (False, {}, "'prompt' must be"),
    (False, {"prompt": 3}, "'prompt' must be"),
    (False, {"prompt": []}, "'prompt' must be"),
    (False, {"prompt": ["a", "b"]}, "'prompt' must be"),
    (False, {"prompt": [1, "a"]}, "'prompt' must be"),
    (False, {"prompt": [True, False]}, "'prompt' must be"),
])
def test_bad_requests_say_what_is_wrong(tokdir: Path, chat: bool, body: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PromptTokenizer.from_dir(tokdir).prompt_ids(body, chat=chat)


def test_template_errors_and_missing_templates(tokdir: Path, richdir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chat template rejected the request: unknown role robot"):
        PromptTokenizer.from_dir(richdir).prompt_ids({"messages": [{"role": "robot", "content": "x"}]}, chat=True)
    bare = variant(tokdir, tmp_path / "bare", chat_template=None)
    (bare / "chat_template.jinja").unlink()
    tok = PromptTokenizer.from_dir(bare)
    assert not tok.has_chat_template and tok.prompt_ids({"prompt": "ok"}, chat=False)
    with pytest.raises(ValueError, match="no chat template"):
        tok.prompt_ids({"messages": SYSTEM_USER}, chat=True)


def test_template_sources_and_precedence(tokdir: Path, tmp_path: Path) -> None:
    # chat_template.jinja wins over the config's chat_template; without it the config's is used
    both = variant(tokdir, tmp_path / "both", "JINJA{{ messages[0]['content'] }}", chat_template="CONFIG")
    assert PromptTokenizer.from_dir(both).render_chat({"messages": SYSTEM_USER}) == "JINJAYou are a terse assistant."
    (both / "chat_template.jinja").unlink()
    assert PromptTokenizer.from_dir(both).render_chat({"messages": SYSTEM_USER}) == "CONFIG"
    # named templates: tool_use when the request has tools, default otherwise
    named = variant(tokdir, tmp_path / "named", chat_template=[{"name": "default", "template": "D"},
                                                               {"name": "tool_use", "template": "T{{ tools|length }}"}])
    (named / "chat_template.jinja").unlink()
    tok = PromptTokenizer.from_dir(named)
    assert tok.render_chat({"messages": SYSTEM_USER}) == "D"
    assert tok.render_chat({"messages": SYSTEM_USER, "tools": TOOLS}) == "T1"
    # tojson as transformers defines it: no HTML escaping, non-ASCII kept
    js = variant(tokdir, tmp_path / "js", "{{ messages[0] | tojson }}")
    assert PromptTokenizer.from_dir(js).render_chat({"messages": [{"role": "user", "content": "<ü>&"}]}) \
        == '{"role": "user", "content": "<ü>&"}'


def test_missing_or_bad_files_are_named(tokdir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json: missing"):
        PromptTokenizer.from_dir(tmp_path)
    bad = variant(tokdir, tmp_path / "bad")
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: cannot read as JSON"):
        PromptTokenizer.from_dir(bad)
    (bad / "tokenizer_config.json").write_text("{}")
    (bad / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match=r"tokenizer.json: not a tokenizers file"):
        PromptTokenizer.from_dir(bad)
    (bad / "tokenizer.json").unlink()
    shutil.copy(tokdir / "tokenizer.json", bad / "tokenizer.json")
    (bad / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="chat template does not compile"):
        PromptTokenizer.from_dir(bad)


def reference(script: str, model_dirs: list[Path], cases: list[tuple[bool, dict]], timeout: int) -> list[list]:
    """Run a reference script once in .venv-vllm over ``cases`` for each model directory; the script prints
    one ``RESULT <json list>`` line per directory."""
    payload = json.dumps([{"chat": chat, "body": body} for chat, body in cases])
    run = subprocess.run([str(VLLM_PY), "-c", script, *map(str, model_dirs)], input=payload, capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, **ENV})
    results = [json.loads(ln.removeprefix("RESULT ")) for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and len(results) == len(model_dirs), run.stderr[-3000:]
    return results


TRANSFORMERS_REF = """
import json, sys
from transformers import AutoTokenizer
cases = json.load(sys.stdin)
for model_dir in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for case in cases:
        b = case["body"]
        if case["chat"]:  # what vLLM does for chat: render to text, then encode (add_special_tokens default False)
            text = tok.apply_chat_template(b["messages"], tools=b.get("tools"), tokenize=False,
                                           add_generation_prompt=b.get("add_generation_prompt", True),
                                           continue_final_message=b.get("continue_final_message", False))
            out.append(tok(text, add_special_tokens=b.get("add_special_tokens", False))["input_ids"])
        else:
            out.append(tok(b["prompt"], add_special_tokens=b.get("add_special_tokens", True))["input_ids"])
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not VLLM_PY.exists(), reason=".venv-vllm (transformers) is missing")
def test_agrees_with_transformers(tokdir: Path, bosdir: Path, richdir: Path, tmp_path: Path) -> None:
    dirs = {"tokenizer-only": tokdir, "adds-bos": bosdir, "rich-template": richdir,
            # transformers ignores add_bos_token when there is a tokenizer.json: so must we
            "config-add_bos_token": variant(tokdir, tmp_path / "m", add_bos_token=True, add_eos_token=True)}
    if (TINY_LLAMA / "tokenizer.json").exists():
        dirs["tiny-llama"] = TINY_LLAMA
    cases = PLAIN_CASES + [(True, {"messages": MULTI_TURN, "tools": TOOLS})]
    expected = reference(TRANSFORMERS_REF, list(dirs.values()), cases, timeout=300)
    for (which, model_dir), want_all in zip(dirs.items(), expected, strict=True):
        tok = PromptTokenizer.from_dir(model_dir)
        for (chat, body), want in zip(cases, want_all, strict=True):
            assert tok.prompt_ids(body, chat=chat) == want, (which, body)


VLLM_REF = """
import json, sys
from vllm.config import ModelConfig, VllmConfig
from vllm.renderers.registry import renderer_from_config
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
cases = json.load(sys.stdin)
for model_dir in sys.argv[1:]:
    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, max_model_len=2048)
    renderer = renderer_from_config(VllmConfig(model_config=model_config))
    out = []
    for case in cases:  # the steps vLLM's OpenAI server takes (renderers/online_renderer.py)
        body = {"model": "m", **case["body"]}
        if case["chat"]:
            req = ChatCompletionRequest(**body)
            tools = None if req.tools is None else [t.model_dump() for t in req.tools]
            params = req.build_chat_params(None, "auto").with_defaults({"tools": tools, "tokenize": False})
            _, prompts = renderer.render_chat([req.messages], params, req.build_tok_params(model_config))
        else:
            req = CompletionRequest(**body)
            prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
            prompt = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
            prompts = renderer.render_cmpl([prompt], req.build_tok_params(model_config))
        out.append(list(prompts[0]["prompt_token_ids"]))
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.skipif(not VLLM_PY.exists() or not (TINY_LLAMA / "config.json").exists(),
                    reason=".venv-vllm or the tiny-llama model is missing")
def test_agrees_with_vllm_renderer(bosdir: Path, richdir: Path, tmp_path: Path) -> None:
    """vLLM's own renderer (message parsing, kwargs merging, template, tokenization) on the same bodies.

    Heavy-ish (imports vLLM): run it as ``flock /tmp/heavy.lock pytest -m vllm ...`` on a shared machine."""
    dirs = {"tiny-llama": TINY_LLAMA}
    for which, src in (("rich-template", richdir), ("adds-bos", bosdir)):
        dirs[which] = shutil.copytree(src, tmp_path / which)
        shutil.copy(TINY_LLAMA / "config.json", dirs[which])  # vLLM's config wants a model: borrow the tiny one's
    expected = reference(VLLM_REF, list(dirs.values()), VLLM_CASES, timeout=600)
    for (which, model_dir), want_all in zip(dirs.items(), expected, strict=True):
        tok = PromptTokenizer.from_dir(model_dir)
        for (chat, body), want in zip(VLLM_CASES, want_all, strict=True):
            assert tok.prompt_ids(body, chat=chat) == want, (which, body)
