"""The prompt token ids a vLLM OpenAI server computes for a request, without torch or transformers.

vLLM hashes KV blocks of *token ids*, so cache-aware routing needs exactly the ids vLLM will compute.
This module gets them from the model's own ``tokenizer.json`` (``tokenizers``) and chat template
(sandboxed jinja2), following vLLM 0.32: for ``/v1/chat/completions`` the messages are normalised as
vLLM parses them (text parts joined with newlines, or kept as parts when the template loops over
``message.content``; tool-call arguments parsed; ``developer`` made ``system`` for templates that do
not know it), rendered as transformers' ``apply_chat_template(tokenize=False)`` does, and encoded with
``add_special_tokens`` (default False); for ``/v1/completions`` a string prompt is encoded with
``add_special_tokens`` (default True) and token ids are taken as they are.

What is not reproduced raises ``ValueError``, so the caller routes without cache knowledge: multimodal
parts, request-supplied chat templates, ``truncate_prompt_tokens``, prompt embeddings, several
completion prompts in one request. Extra keys on content parts are not passed to the template, and
model-specific transformers tokenizer classes are not imitated: ``tokenizer.json`` is the truth.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer

from . import promptmessages as pm
from .segmentcache import SegmentEncoder

SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's own parameters: accepted from chat_template_kwargs but not template variables.
APPLY_PARAMS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                          "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # the marker transformers appends to the message to continue
UNSET = (None, "auto")  # values vLLM's kwargs merging treats as "not given"
MAX_PROMPT_CHARS = 1_000_000   # longer prompts are not tokenized for routing (a second of the event loop, or more)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers in some templates): render the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (no HTML escaping, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """Strip filters, tests and slices: ``messages[1:]|reverse`` is still ``messages``."""
    while True:
        wrapper = isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None
        if wrapper or (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
            node = node.node
        else:
            return node


def _is_name(node: jinja2.nodes.Node, names: set[str]) -> bool:
    node = _unwrap(node)
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _is_content_of(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """Whether ``node`` is ``m['content']`` or ``m.content`` for a name ``m`` in ``names``."""
    node = _unwrap(node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == "content" and _is_name(node.node, names)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    return False


def loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether a template loops over a message's content (vLLM then passes it as a list of parts), found as
    vLLM finds it: a ``for`` over ``message.content`` (``message`` walking ``messages`` or a variable set
    from it), over a macro parameter called with ``message.content``, or over a bare ``content`` outside macros.
    """
    lists = {"messages"}
    changed = True
    while changed:  # follow {% set x = messages[...] %} chains
        changed = False
        for assign in ast.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and assign.target.name not in lists \
                    and _is_name(assign.node, lists):
                lists.add(assign.target.name)
                changed = True
    loops = list(ast.find_all(jinja2.nodes.For))
    items = {lp.target.name for lp in loops if isinstance(lp.target, jinja2.nodes.Name) and _is_name(lp.iter, lists)}
    in_macro: dict[int, set[str]] = {}
    for macro in ast.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        fed: set[str] = set()
        for call in ast.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                fed |= {params[i] for i, arg in enumerate(call.args[:len(params)]) if _is_content_of(arg, items)}
                fed |= {kw.key for kw in call.kwargs if kw.key in params and _is_content_of(kw.value, items)}
        for loop in macro.find_all(jinja2.nodes.For):
            in_macro[id(loop)] = fed
    for loop in loops:
        if _is_content_of(loop.iter, items):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if id(loop) in in_macro and loop.iter.name in in_macro[id(loop)]:
                return True
            if id(loop) not in in_macro and loop.iter.name == "content":
                return True
    return False


class _Template:
    """One compiled chat template and the facts about it that rendering needs, worked out once."""

    def __init__(self, env: jinja2.Environment, source: str):
        self.source = source
        ast = env.parse(source)
        self.compiled = env.from_string(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.parts_format = loops_over_content(ast)
        self.knows_developer = '"developer"' in source or "'developer'" in source


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken-like object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptTokenizer:
    """A model's tokenizer and chat template, giving the prompt ids vLLM would compute for a request."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: dict[str, str], templates: dict[str, str],
                 source: str = "<memory>"):
        """``templates`` maps names to jinja sources (one unnamed model template is ``{"default": ...}``)."""
        self._tok = tokenizer
        self._pieces = SegmentEncoder(tokenizer)   # chat prompts' repeated text encoded once
        self.max_chars = MAX_PROMPT_CHARS   # a longer prompt is not tokenized (ValueError)
        self.special_tokens = dict(special_tokens)
        self.source = source
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._templates = {name: _Template(env, text) for name, text in templates.items()}
        except jinja2.TemplateError as e:
            raise ValueError(f"{source}: chat template does not compile: {e}") from e

    def with_chat_template(self, template: str, source: str) -> PromptTokenizer:
        """The same tokenizer with ``template`` for every request (the engine's ``--chat-template``)."""
        return PromptTokenizer(self._tok, self.special_tokens, {"default": template}, source=source)

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        """Load a model directory: ``tokenizer.json`` (the truth for encoding, its post-processor included:
        transformers ignores ``add_bos_token`` when it exists), ``tokenizer_config.json`` (optional: special
        tokens, ``chat_template``) and ``chat_template.jinja`` (optional, preferred over the config's)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{tok_file}: missing (a fast tokenizer file is needed)")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{tok_file}: not a tokenizers file: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        special = {a: s for a in SPECIAL_TOKEN_ATTRS if (s := _token_str(cfg.get(a))) is not None}
        decoder = cfg.get("added_tokens_decoder") or {}
        wanted = [AddedToken(t["content"], special=bool(t.get("special", True)), lstrip=bool(t.get("lstrip")),
                             rstrip=bool(t.get("rstrip")), normalized=bool(t.get("normalized")),
                             single_word=bool(t.get("single_word")))
                  for _, t in sorted(decoder.items(), key=lambda kv: int(kv[0])) if isinstance(t, dict)]
        wanted += [AddedToken(s, special=True, normalized=False) for s in special.values()]
        missing = [t for t in wanted if tok.token_to_id(t.content) is None]
        if missing:  # transformers adds named special tokens the tokenizer.json lacks
            tok.add_special_tokens(missing)
        # Template files replace the config's templates (chat_template.jinja is the default one), as in transformers.
        files = {"default": path / "chat_template.jinja"} | {
            f.stem: f for f in sorted((path / "additional_chat_templates").glob("*.jinja"))}
        templates: dict[str, str] = {}
        for name, file in files.items():
            if file.is_file():
                try:
                    templates[name] = file.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as e:
                    raise ValueError(f"{file}: cannot read: {e}") from e
        raw = cfg.get("chat_template")
        if not templates and isinstance(raw, str):
            templates = {"default": raw}
        elif not templates and isinstance(raw, list):
            templates = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
        return cls(tok, special, templates, source=str(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (every id ``decode`` knows is below it)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.max_chars:   # (encoding runs on the gateway's event loop: 8 MB took 13 s)
            raise ValueError(f"the prompt's {len(text)} characters are more than the {self.max_chars} tokenized here")
        if not add_special_tokens:
            return self._pieces.encode(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        """The prompt token ids vLLM computes for this ``/v1/chat/completions`` (``chat``) or
        ``/v1/completions`` request body; ``ValueError`` says why when they cannot be computed here."""
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        for key in ("truncate_prompt_tokens", "prompt_embeds"):
            if body.get(key) is not None:
                raise ValueError(f"'{key}' is not supported for prompt tokenization")
        if chat:
            if "system" in body:   # a Messages (Anthropic) body: its system leads the chat, as vLLM makes it
                body = {**body, "messages": [*pm.messages_api_system(body), *(body.get("messages") or [])]}
            return self.encode(self.render_chat(body), bool(body.get("add_special_tokens", False)))
        return self._completion_ids(body.get("prompt"), bool(body.get("add_special_tokens", True)))

    def _completion_ids(self, prompt: Any, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            if not all(0 <= i < 2**32 for i in prompt):
                raise ValueError("'prompt' has a token id out of range")
            return list(prompt)
        raise ValueError("'prompt' must be a string, a non-empty list of token ids, or a list of exactly one of those")

    def render_chat(self, body: dict) -> str:
        """The chat prompt text vLLM renders for a ``/v1/chat/completions`` body (before tokenizing)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        if body.get("chat_template") is not None:
            raise ValueError("a request-supplied 'chat_template' is not supported")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' must be a list")
        kwargs = self._template_kwargs(body, None if tools is None else [pm.tool(t) for t in tools])
        template = self._template(kwargs["tools"] is not None)
        conv = [pm.message(m, template.parts_format) for m in messages]
        if not template.knows_developer and any(m["role"] == "developer" for m in conv):
            conv = pm.developer_as_system(conv)
        return self._render(template, conv, kwargs)

    def _template_kwargs(self, body: dict, tools: list[dict] | None) -> dict[str, Any]:
        """Merge request fields and ``chat_template_kwargs`` the way vLLM does (request fields win, None and
        "auto" count as unset)."""
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        if bad := {"chat_template", "tokenize"} & user.keys():
            raise ValueError(f"unsupported chat_template_kwargs: {sorted(bad)}")
        effort = body.get("reasoning_effort")
        extra = {"add_generation_prompt": body.get("add_generation_prompt", True),
                 "continue_final_message": body.get("continue_final_message", False),
                 "documents": body.get("documents"), "reasoning_effort": effort}
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
        merged = dict(user) | {k: v for k, v in extra.items() if v not in UNSET}
        return {"tools": tools} | {k: v for k, v in merged.items() if v not in UNSET}

    def _template(self, with_tools: bool) -> _Template:
        if not self._templates:
            raise ValueError(f"{self.source}: no chat template (tokenizer_config.json or chat_template.jinja)")
        if len(self._templates) == 1 and "default" in self._templates:
            return self._templates["default"]
        name = "tool_use" if with_tools and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise ValueError(f"{self.source}: no 'default' chat template among {sorted(self._templates)}")
        return self._templates[name]

    def _render(self, template: _Template, conv: list[dict], kwargs: dict[str, Any]) -> str:
        """Render like ``apply_chat_template(tokenize=False)``, continuing the final message if asked."""
        kwargs = {k: v for k, v in kwargs.items() if k in template.variables or k in APPLY_PARAMS}
        generation_prompt = bool(kwargs.get("add_generation_prompt", False))
        cont = bool(kwargs.get("continue_final_message", False))
        documents = kwargs.get("documents")
        if cont and generation_prompt:
            raise ValueError("cannot set both 'continue_final_message' and 'add_generation_prompt'")
        if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            raise ValueError("'documents' must be a list of objects")
        variables = self.special_tokens | {k: v for k, v in kwargs.items() if k not in APPLY_PARAMS}
        continued = ""
        if cont:
            continued = self._mark_final(template, conv)
        try:
            text = template.compiled.render(messages=conv, tools=kwargs.get("tools"), documents=documents,
                                            add_generation_prompt=generation_prompt, **variables)
        except Exception as e:  # raise_exception(), or the template tripping over an unexpected message shape
            raise ValueError(f"chat template rejected the request: {e}") from e
        if not cont:
            return text
        marker = CONTINUE_TAG.strip()
        if continued.strip() not in text or marker not in text:
            raise ValueError("continue_final_message: the chat template dropped part of the final message")
        at = text.rindex(marker)
        return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()

    @staticmethod
    def _mark_final(template: _Template, conv: list[dict]) -> str:
        """Append the continuation marker to the last message's text; returns that text before marking."""
        last = conv[-1]
        content = last.get("content")
        if content is None:
            raise ValueError("continue_final_message: the final message has no content")
        if "content" not in template.source:
            raise ValueError("continue_final_message: the chat template does not use 'content'")
        if isinstance(content, list):
            for part in reversed(content):
                if "text" in part:
                    original, part["text"] = part["text"], part["text"] + CONTINUE_TAG
                    return original
            raise ValueError("continue_final_message: the final message has no text to continue")
        last["content"] = content + CONTINUE_TAG
        return content
