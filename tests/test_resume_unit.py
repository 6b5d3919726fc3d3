"""Which requests can be continued, and how a broken generation is stitched (vLLM-shaped events, no sockets)."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import ModelConfig
from orchestrator.gateway.resumeplan import plan
from orchestrator.gateway.stitch import Break, Refused, Stitch

M = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False}})


def test_plan_asks_the_replica_for_token_ids_and_usage_and_streams_it():
    spec, up = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9}, M)
    assert up["stream"] is True and up["return_token_ids"] is True and up["stream_options"] == {"include_usage": True}
    assert not spec.stream and not spec.want_ids and not spec.want_usage and spec.max_tokens == 9
    spec, up = plan("/v1/chat/completions", {"model": "m", "messages": [], "stream": True, "max_completion_tokens": 4,
                                             "stream_options": {"include_usage": True}}, M)
    assert spec.chat and spec.stream and spec.want_usage and spec.max_tokens == 4


@pytest.mark.parametrize("extra", [{"n": 2}, {"best_of": 3}, {"echo": True}, {"logprobs": 2},
                                   {"prompt": ["a", "b"]}, {"tools": [{"type": "function"}]},
                                   {"response_format": {"type": "json_object"}}])
def test_plan_leaves_what_cannot_be_continued_alone(extra):
    assert plan("/v1/completions", {"model": "m", "prompt": "hi", **extra}, M) is None
    assert plan("/v1/embeddings", {"model": "m", "input": "hi"}, M) is None
    off = M.model_copy(update={"resume": M.resume.model_copy(update={"enabled": False})})
    assert plan("/v1/completions", {"model": "m", "prompt": "hi"}, off) is None


@pytest.mark.parametrize("extra", [{"frequency_penalty": 1.0}, {"presence_penalty": 0.5}, {"seed": 7.0},
                                   {"seed": "7"}, {"min_tokens": "6"}])
def test_plan_leaves_penalties_on_the_output_and_lax_typed_seeds_alone(extra):
    """vLLM counts presence and frequency penalties on the output alone (a continuation's output starts empty at the
    cut: greedy text diverged after it), and reads a seed or min_tokens of 7.0 or "7" as 7 (a float seed went
    on unchanged, replaying its first draws; a string min_tokens was dropped). Found by a review."""
    assert plan("/v1/completions", {"model": "m", "prompt": "hi", **extra}, M) is None
    for kept in ({"frequency_penalty": 0}, {"presence_penalty": 0.0}, {"seed": 7}, {"min_tokens": 6},
                 {"min_tokens": 6.0}, {"repetition_penalty": 1.2}):   # (repetition_penalty counts the prompt too)
        assert plan("/v1/completions", {"model": "m", "prompt": "hi", **kept}, M) is not None, kept


def test_return_token_ids_false_as_a_string_is_false_as_vllm_reads_it():
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "return_token_ids": "false"}, M)
    assert not spec.want_ids
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "return_token_ids": True}, M)
    assert spec.want_ids


def chunk(i, text, ids, finish=None, prompt_ids=None, rid="cmpl-a"):
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    if prompt_ids is not None:
        ch["prompt_token_ids"] = prompt_ids
    return {"id": rid, "object": "text_completion", "created": 7, "model": "m", "choices": [ch]}


def three_tokens(st: Stitch) -> None:
    """Three tokens (5, 6, 7: "a", "b", "c") of a prompt of two (1, 2), one an event as vLLM sends them."""
    for i, t in enumerate((5, 6, 7)):
        st.take({"id": "x", **({"prompt_token_ids": [1, 2]} if i == 0 else {}), "choices": [
            {"index": 0, "text": "abc"[i], "delta": {"content": "abc"[i]}, "token_ids": [t]}]}, False)


def test_a_stitched_completion_has_one_id_every_token_and_the_usage_of_all():
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True,
                                       "temperature": 0, "stream_options": {"include_usage": True}}, M)
    st = Stitch(spec)
    shown = st.take(chunk(0, " a", [11], prompt_ids=[1, 2, 3]), False) + st.take(chunk(1, " b", [12]), False)
    assert [c["choices"][0]["text"] for c in shown] == [" a", " b"]
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0] for c in shown)
    body = st.continuation_body("m")
    assert body["prompt"] == [1, 2, 3, 11, 12] and body["max_tokens"] == 3 and body["temperature"] == 0
    # the continuation comes from another replica with its own id; the client sees the first one
    shown = st.take(chunk(0, " c", [13], rid="cmpl-b", prompt_ids=[1, 2, 3, 11, 12]), True)
    shown += st.take(chunk(1, " d", [14], rid="cmpl-b"), True)
    shown += st.take(chunk(2, " e", [15], "length", rid="cmpl-b"), True)
    shown += st.take({"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "m", "choices": [],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}, True)
    assert {c["id"] for c in shown} == {"cmpl-a"} and shown[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(st.text) == " a b c d e" and st.ids == [11, 12, 13, 14, 15]
    assert st.usage() == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert st.whole()["choices"][0]["text"] == " a b c d e"


def test_a_chat_continuation_is_shown_as_chat_chunks():
    spec, _ = plan("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                            "stream": True, "return_token_ids": True}, M)
    st = Stitch(spec)
    first = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
    shown = st.take(first, False)
    assert shown[0]["prompt_token_ids"] == [5, 6]        # the client asked for token ids: it keeps them
    st.take({**first, "prompt_token_ids": None, "choices": [
        {"index": 0, "delta": {"content": " x"}, "finish_reason": None, "token_ids": [40]}]}, False)
    assert st.take(chunk(0, " y", [41], "stop", rid="cmpl-z"), True) == []   # (the last: held for the fingerprint)
    c, = st.ending()
    assert c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-a"
    assert c["choices"][0]["delta"] == {"content": " y"} and c["choices"][0]["token_ids"] == [41]
    assert st.whole()["choices"][0]["message"]["content"] == " x y"
    # the role is the replica's (vLLM's --response-role, or the last message's with add_generation_prompt false):
    # a whole answer said "assistant" whatever it was. Found by a review.
    st = Stitch(spec)
    st.take({**first, "choices": [{**first["choices"][0], "delta": {"role": "narrator", "content": ""}}]}, False)
    st.take(chunk(0, " z", [42], "stop", rid="chatcmpl-a"), False)
    assert st.whole()["choices"][0]["message"]["role"] == "narrator"


@pytest.mark.parametrize("max_tokens, max_model_len, ends", [
    (100, 5, True),    # the context full (2 + 3 of 5) under a larger max_tokens: complete, with "length"
    (100, 6, False),   # a token of room: continued
    (3, 0, True),      # every token it asked for (no context known)
    (None, 5, True),   # no max_tokens: the context's end
])
def test_a_break_on_the_last_token_of_a_full_context_ends_the_answer(max_tokens, max_model_len, ends):
    """vLLM lowers a max_tokens larger than the context left; a generation that filled the context and broke on
    its last token was continued with no room (a 400, a migration spent on every replica, then an error for a
    client that had every token). Found by a review."""
    body = {"model": "m", "prompt": "hi", "stream": True, **({"max_tokens": max_tokens} if max_tokens else {})}
    st = Stitch(plan("/v1/completions", body, M)[0])
    three_tokens(st)
    assert st.ran_out(max_model_len) is ends and (st.finish == "length") is ends


def test_an_engine_error_event_is_a_break_and_no_token_ids_means_no_continuation():
    st = Stitch(plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, M)[0])
    with pytest.raises(Break) as b:
        st.take({"error": {"message": "engine dead", "code": 500}}, False)
    assert b.value.cause == "engine_error"
    hidden = Stitch(plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, M)[0])
    hidden.take({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "text": " a", "finish_reason": None}]},
                False)
    assert hidden.continuation_body("m") is None


@pytest.mark.parametrize("body", [{"logprobs": 0}, {"stop": ["\\n\\nHuman:"]}, {"top_logprobs": 0}])
def test_asked_for_however_falsy_logprobs_and_stop_strings_are_not_resumed(body):
    # logprobs: 0 asks for the chosen token's; with stop strings the engine holds text back while it
    # streams the token ids, so a continuation would lose that text
    assert plan("/v1/completions", {"model": "m", "prompt": "hi", **body}, M) is None


def test_false_is_off_only_where_vllm_types_the_option_bool():
    """vLLM reads ``false`` as 0 where an option is a number: a completion's ``logprobs: false`` asks for the
    sampled token's logprob and ``prompt_logprobs: false`` for the prompt's, which a continuation would drop; a
    chat's ``logprobs`` and ``echo`` are bools (false: off)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    for body in ({"logprobs": False}, {"prompt_logprobs": False}):
        assert plan("/v1/completions", {"model": "m", "prompt": "hi", **body}, M) is None, body
    assert plan("/v1/chat/completions", {**chat, "prompt_logprobs": False}, M) is None
    for body in ({"logprobs": False}, {"echo": False}, {"return_prompt_text": False}, {"use_beam_search": False}):
        assert plan("/v1/chat/completions", {**chat, **body}, M) is not None, body
    assert plan("/v1/completions", {"model": "m", "prompt": "hi", "echo": False}, M) is not None


@pytest.mark.parametrize("extra", [{"return_prompt_text": True}, {"return_token_offsets": True},
                                   {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}},
                                   {"logprob_token_ids": [5]}, {"kv_transfer_params": {"do_remote_decode": True}},
                                   {"thinking_token_budget": 100}])
def test_what_a_continuation_cannot_rebuild_or_keep_across_the_seam_is_not_resumed(extra):
    """A first chunk's prompt text, token offsets, chosen tokens' logprobs: fields the stitched answer lacked; a
    repetition window or a thinking budget restarted at the seam; a disaggregated prefill's transfer."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, **extra}
    assert plan("/v1/chat/completions", chat, M) is None


def test_a_continuation_keeps_the_watermark():
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 9,
                                       "watermarking": True, "stream_interval": 1}, M)
    st = Stitch(spec)
    st.take(chunk(0, "a", [5], prompt_ids=[1, 2]), False)
    body = st.continuation_body("m")
    assert body["watermarking"] is True and body["stream_interval"] == 1 and body["max_tokens"] == 8


@pytest.mark.parametrize("request_k,engine_k", [(4, None), (None, "2"), (1, "3"), (2.0, None)])
def test_a_stream_of_several_tokens_an_event_is_not_resumed(request_k, engine_k):
    """vLLM sends k tokens an event (the larger of the request's stream_interval and the engine's): an event can end
    in the first bytes of a character, its text held back and its id not, and a cut there gave the next replica a
    prompt ending mid-character (the client then got the prompt's text in its answer)."""
    model = M.model_copy(update={"vllm_args": {**M.vllm_args, **({"stream-interval": engine_k} if engine_k else {})}})
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 9,
            **({"stream_interval": request_k} if request_k else {})}
    assert plan("/v1/completions", body, model) is None
    assert plan("/v1/completions", {**body, "stream_interval": 1}, M) is not None


def test_a_reasoning_model_gpt_oss_and_bad_words_are_not_resumed(tmp_path):
    """A reasoning parser, or gpt-oss (vLLM parses its harmony channels with no flag: after a move the client got
    the raw channel text as content), splits the output in fields a continuation cannot rebuild; a bad word split
    by a move would pass (vLLM matches its first tokens among the generated ones only)."""
    from orchestrator.gateway.genconfig import generation_limits
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}')
    for extra in ({"vllm_args": {"reasoning-parser": "deepseek_r1"}}, {"model_path": str(tmp_path)}):
        r = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False}, **extra})
        assert plan("/v1/chat/completions", chat, r, generation_limits(r)) is None
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = ModelConfig.model_validate({"name": "m", "engine": "simulator", "container": {"enabled": False},
                                    "model_path": str(tmp_path)})
    assert plan("/v1/chat/completions", chat, r, generation_limits(r)) is not None
    assert plan("/v1/chat/completions", {**chat, "bad_words": ["New York"]}, r, generation_limits(r)) is None


def test_a_vllm_model_whose_config_is_not_readable_here_is_not_resumed_and_binds_lead_to_it(tmp_path):
    """model_path is the engine's, inside its container: read as it is on the daemon's host it was not found, and
    a gpt-oss model (vLLM splits its output into reasoning with no flag) was continued as a plain one: its
    reasoning dropped from every chat, a move or not. Now it is found through the container's binds, and a vLLM
    model whose config.json cannot be read is not continued; nor one whose reasoning parser comes in the
    structured outputs' config. Found by a review."""
    from orchestrator.gateway.genconfig import generation_limits, host_path
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    (tmp_path / "models" / "oss").mkdir(parents=True)
    (tmp_path / "models" / "oss" / "config.json").write_text('{"model_type": "gpt_oss"}')
    (tmp_path / "models" / "llama").mkdir()
    (tmp_path / "models" / "llama" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "models" / "llama" / "generation_config.json").write_text('{"max_new_tokens": 40}')

    def vllm(path: str, **kw) -> ModelConfig:
        return ModelConfig.model_validate({"name": "m", "engine": "vllm", "model_path": path, "container": {
            "image": "/i.sif", "binds": [f"{tmp_path}/models:/models:ro"]}, **kw})
    assert host_path(vllm("/models/oss"), "/models/oss") == f"{tmp_path}/models/oss"
    assert host_path(vllm("/models/oss"), "/modelsx/oss") == "/modelsx/oss"   # (not under the bind)
    assert plan("/v1/chat/completions", chat, vllm("/models/oss"), generation_limits(vllm("/models/oss"))) is None
    assert plan("/v1/chat/completions", chat, vllm("/nowhere"), generation_limits(vllm("/nowhere"))) is None
    assert generation_limits(vllm("/models/llama")) == (40, None)   # (its generation config through the bind too)
    assert plan("/v1/chat/completions", chat, vllm("/models/llama"), generation_limits(vllm("/models/llama")))
    parser = vllm("/models/llama", vllm_args={"structured-outputs-config": '{"reasoning_parser": "qwen3"}'})
    assert generation_limits(parser) is None
    # a default presence or frequency penalty (vLLM counts it on the output alone): not continued; a review found it
    gen = tmp_path / "models" / "llama" / "generation_config.json"
    gen.write_text('{"max_new_tokens": 40, "frequency_penalty": 0.3}')
    assert generation_limits(vllm("/models/llama")) is None
    gen.write_text('{"max_new_tokens": 40}')
    penalised = vllm("/models/llama", vllm_args={"override-generation-config": '{"presence_penalty": 0.5}'})
    assert generation_limits(penalised) is None and generation_limits(vllm("/models/llama")) == (40, None)


@pytest.mark.parametrize("path, body, left", [
    # to the context's end: the replica's max_model_len, once it is chosen (a larger number is a 400)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": None}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                              "max_completion_tokens": 20}, 20 - 3),   # vLLM's order
    ("/v1/completions", {"prompt": "x"}, 16 - 3),          # what is left of the engine's default, 16
    ("/v1/completions", {"prompt": "x", "max_tokens": None}, 16 - 3),   # null is 16 too (vLLM 0.32)
    ("/v1/completions", {"prompt": "x", "max_tokens": 50}, 50 - 3),
    ("/v1/completions", {"prompt": "x", "max_tokens": 50.0}, 50 - 3),   # (it ran to the context's end: 4,092)
])
def test_a_continuation_asks_for_what_is_left_of_the_generation(path, body, left):
    spec, _ = plan(path, {"model": "m", "stream": True, **body}, M)
    st = Stitch(spec)
    three_tokens(st)
    assert st.continuation_body("m")["max_tokens"] == left   # (a chat without one was cut 16 tokens later)


@pytest.mark.parametrize("vllm_args, gen, path, body, left", [
    # generation_config.json's max_new_tokens is vLLM's max_tokens of a chat without one (was: the context's end)
    ({}, {"max_new_tokens": 40}, "/v1/chat/completions", {}, 40 - 3),
    ({}, {"max_new_tokens": 40}, "/v1/chat/completions", {"max_tokens": 100}, 100 - 3),   # no cap with auto
    ({}, {"max_new_tokens": 40}, "/v1/completions", {}, 16 - 3),   # a completion's default is 16 whatever
    ({"generation-config": "vllm"}, {"max_new_tokens": 40}, "/v1/chat/completions", {}, None),   # not read
    # an override is the default and caps every request (in total: the continuation asks for the rest of it)
    ({"override-generation-config": '{"max_new_tokens": 30}'}, {"max_new_tokens": 40}, "/v1/chat/completions",
     {"max_tokens": 100}, 30 - 3),
    ({"override-generation-config": '{"max_new_tokens": 30}'}, {}, "/v1/completions", {"max_tokens": 20}, 20 - 3),
    ({}, {}, "/v1/chat/completions", {}, None),   # no generation config: the context's end
])
def test_a_continuation_stops_where_the_generation_config_would(tmp_path, vllm_args, gen, path, body, left):
    from orchestrator.gateway.genconfig import generation_limits
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **gen}))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    m = ModelConfig(name="m", engine="vllm", model_path=str(tmp_path), vllm_args=vllm_args, container={"enabled": False})
    msgs = {"messages": [{"role": "user", "content": "x"}]} if path.endswith("chat/completions") else {"prompt": "x"}
    spec, _ = plan(path, {"model": "m", "stream": True, **msgs, **body}, m, generation_limits(m))
    st = Stitch(spec)
    three_tokens(st)
    assert st.continuation_body("m")["max_tokens"] == left


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("path, body", [
    # the prompt's ids hold an image's placeholder tokens, not the image: a continuation would go on without it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 50.5}),
])
def test_a_generation_that_a_continuation_could_not_rebuild_is_not_resumed(path, body):
    assert plan(path, {"model": "m", "stream": True, **body}, M) is None
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}]}]}
    assert plan("/v1/chat/completions", {"model": "m", "stream": True, **text}, M) is not None


@pytest.mark.parametrize("min_tokens", [10, 10.0])
def test_a_continuation_keeps_what_is_left_of_min_tokens_and_a_chat_chunk_its_stop_reason(min_tokens):
    """min_tokens 10.0 (vLLM reads it as 10) was not carried: the rest could end at EOS too early; a chat
    continuation's chunk left out the stop_reason vLLM's own chat chunks carry."""
    spec, _ = plan("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                            "stream": True, "min_tokens": min_tokens}, M)
    st = Stitch(spec)
    for i, t in enumerate((40, 41, 42)):   # (one token an event, as vLLM sends them)
        st.take({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 **({"prompt_token_ids": [5, 6]} if i == 0 else {}), "choices": [{"index": 0, "delta": {
                     **({"role": "assistant"} if i == 0 else {}), "content": " x"}, "finish_reason": None,
                     "token_ids": [t]}]}, False)
    assert st.continuation_body("m")["min_tokens"] == 7
    last = {**chunk(0, ".", [2], "stop", rid="cmpl-z")}
    last["choices"][0]["stop_reason"] = 2
    assert st.take(last, True) == [] and st.ending()[0]["choices"][0]["stop_reason"] == 2


@pytest.mark.parametrize("stream,usage", [(True, False), (True, True), (False, False)])
def test_vllms_fingerprint_reaches_the_client_where_vllm_puts_it(stream, usage):
    """vLLM (0.32, --fingerprint-mode full) sends system_fingerprint on a stream's usage chunk when the stream asked
    for usage (the gateway always asks), on its last chunk when not, and on a whole answer: a continued request
    lost it everywhere."""
    body = {"model": "m", "prompt": "hi", "stream": stream, "max_tokens": 2}
    if usage:
        body["stream_options"] = {"include_usage": True}
    spec, up = plan("/v1/completions", body, M)
    assert up["stream_options"]["include_usage"] is True
    st = Stitch(spec)
    assert len(st.take(chunk(0, "a", [5], prompt_ids=[1, 2]), False)) == 1
    shown = st.take(chunk(0, "b", [6], "length"), False)   # the finish chunk: held when it is to carry it
    assert [c["choices"][0]["finish_reason"] for c in shown] == (["length"] if usage else [])
    st.take({"id": "cmpl-a", "object": "text_completion", "created": 7, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
             "system_fingerprint": "vllm-0.32.0-abcd1234"}, False)
    if not stream:
        assert st.whole()["system_fingerprint"] == "vllm-0.32.0-abcd1234"
        return
    last, = st.ending()
    assert last["system_fingerprint"] == "vllm-0.32.0-abcd1234"
    if usage:   # the usage chunk carries it; the finish chunk went out as it came
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    else:
        assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["text"] == "b"


def test_a_continuation_keeps_the_cache_salt_and_the_engines_extra_arguments():
    """A salted prompt's continuation (the whole conversation) must not land in the shared, unsalted cache."""
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "x", "stream": True, "max_tokens": 20,
                                       "cache_salt": "tenant-a", "vllm_xargs": {"k": 1}}, M)
    st = Stitch(spec)
    three_tokens(st)
    body = st.continuation_body("m")
    assert body["cache_salt"] == "tenant-a" and body["vllm_xargs"] == {"k": 1}


def test_an_engine_client_error_event_is_the_requests_not_the_replicas():
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "x", "stream": True}, M)
    bad = {"error": {"message": "Token id 999999 is out of vocabulary", "type": "BadRequestError", "code": 400}}
    with pytest.raises(Refused):
        Stitch(spec).take(bad, False)
    dead = {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError", "code": 500}}
    with pytest.raises(Break):
        Stitch(spec).take(dead, False)


async def test_an_engine_refusal_before_anything_was_sent_keeps_the_request_id_and_rate_limit_headers():
    """(They were dropped: a non-streamed request refused by the engine's event came back bare.)"""
    from types import SimpleNamespace

    from orchestrator.gateway.resume import _refused
    bad = {"error": {"message": "Token id 999999 is out of vocabulary", "type": "BadRequestError", "code": 400}}
    p = SimpleNamespace(code=None)
    resp = await _refused(p, bad, None, {"x-request-id": "r1", "x-ratelimit-limit-requests": "3"}, 10.0)
    assert resp.status == 400 and resp.headers["x-request-id"] == "r1"
    assert resp.headers["x-ratelimit-limit-requests"] == "3" and p.code == 400   # (the status requests_total counts)


def test_continuous_usage_stats_count_every_token_of_the_generation_across_a_move():
    spec, up = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True, "stream_options":
                                        {"include_usage": True, "continuous_usage_stats": True}}, M)
    assert up["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    st = Stitch(spec)
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    shown = st.take({**chunk(0, " a", [11], prompt_ids=[1, 2, 3]), "usage": usage}, False)
    shown += st.take({**chunk(1, " b", [12]), "usage": {**usage, "completion_tokens": 2, "total_tokens": 5}}, False)
    # the continuation's engine counts its own prompt (the original and what was generated) and tokens
    shown += st.take(chunk(0, " c", [13], rid="cmpl-b", prompt_ids=[1, 2, 3, 11, 12]), True)
    shown += st.take({**chunk(1, " d", [14], "length", rid="cmpl-b"),
                      "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}, True)
    assert [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"], c["usage"]["total_tokens"])
            for c in shown] == [(3, 1, 4), (3, 2, 5), (3, 3, 6), (3, 4, 7)]
    plain, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True, "stream_options":
                                        {"include_usage": False, "continuous_usage_stats": True}}, M)
    st = Stitch(plain)   # (vLLM: continuous usage only with include_usage)
    assert "usage" not in st.take(chunk(0, " a", [11], prompt_ids=[1, 2, 3]), False)[0]


def test_a_seeded_continuation_draws_with_a_seed_of_its_own_per_cut_point():
    """vLLM seeds a request's generator when it starts: the same seed again replayed the answer's first draws
    after the seam (a sample pulled towards its opening); the seed is one of the cut point's, stable for it."""
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True,
                                       "temperature": 1.0, "seed": 7}, M)
    seeds = []
    for cut in (1, 2, 2):
        st = Stitch(spec)
        for i in range(cut):
            st.take(chunk(0, " a", [11], prompt_ids=[1, 2] if i == 0 else None), False)
        seeds.append(st.continuation_body("m")["seed"])
    assert seeds[0] != 7 and seeds[1] != seeds[0] and seeds[1] == seeds[2] and 0 <= min(seeds) < 2 ** 31
    unseeded = Stitch(plan("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, M)[0])
    unseeded.take(chunk(0, " a", [11], prompt_ids=[1, 2]), False)
    assert "seed" not in unseeded.continuation_body("m")


def test_stream_options_on_a_request_not_streamed_gets_the_engines_own_400():
    """(resume streamed it from the replica, so the engine never saw the combination it refuses)"""
    body = {"model": "m", "prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}
    assert plan("/v1/completions", body, M) is None
    assert plan("/v1/completions", {**body, "stream": True}, M) is not None


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_tokens_of_half_a_character_wait_for_their_text_and_a_break_cuts_before_them(cut):
    """A character split over byte tokens (an emoji) comes as chunks with token ids and no text until it is whole.
    A break there made a continuation prompt ending in half a character, and vLLM's detokenizer then answers with
    the whole prompt's text (checked on vLLM 0.32 with the tiny model's tokenizer): the client got its prompt in
    the answer.  Now those ids wait, unshown, for the text that completes them; a break before it cuts the
    continuation before them, and the next replica generates the character again."""
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True,
                                       "return_token_ids": True}, M)
    st = Stitch(spec)
    shown = st.take(chunk(0, " a", [11], prompt_ids=[1, 2]), False)
    parts = [[224], [176], [257]]   # the emoji's bytes: text only with the last
    for ids in parts[:cut]:
        shown += st.take(chunk(0, "", ids), False)
    assert [c["choices"][0]["text"] for c in shown] == [" a"] and st.ids == [11]
    if cut < 3:   # the replica dies here: the continuation starts before the character, whose ids the client never saw
        body = st.continuation_body("m")
        assert body["prompt"] == [1, 2, 11] and body["max_tokens"] == 8
        st.cut()   # (as the relay does when the continuation's replica takes over)
        shown += st.take(chunk(0, "", [224], rid="cmpl-b"), True)
        shown += st.take(chunk(0, "", [176], rid="cmpl-b"), True)
        shown += st.take(chunk(0, "", [257], rid="cmpl-b"), True)
        shown += st.take(chunk(0, " 🦙", [103], rid="cmpl-b"), True)
    else:
        shown += st.take(chunk(0, " 🦙", [103]), False)
    shown += st.take(chunk(0, " done", [251], "stop", rid="cmpl-b" if cut < 3 else "cmpl-a"), cut < 3) + st.ending()
    assert [c["choices"][0]["text"] for c in shown] == [" a", " 🦙", " done"]
    assert [c["choices"][0]["token_ids"] for c in shown] == [[11], [224, 176, 257, 103], [251]]
    assert st.ids == [11, 224, 176, 257, 103, 251] and st.usage()["completion_tokens"] == 6
    assert st.whole()["choices"][0]["text"] == " a 🦙 done"


@pytest.mark.parametrize("same", [True, False])
def test_a_cut_after_a_merged_event_that_ends_in_half_a_character_goes_back_before_it(same):
    """vLLM merges a request's outputs into one event when its API server falls behind: several ids, and the text
    of those that ended whole.  Its last ids may be half a character, whose text it holds back; after a cut there
    the gateway (told so by the next replica's /detokenize, see .seam: ``back``) starts the continuation before
    them.  The client already has their ids: made again the same (greedy), they are not shown twice; made
    otherwise (a sample), the skipping ends and the new ids are shown."""
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True,
                                       "return_token_ids": True, "min_tokens": 5, "seed": 3}, M)
    st = Stitch(spec)
    shown = st.take(chunk(0, " a", [11], prompt_ids=[1, 2]), False)
    assert st.merged == 0
    shown += st.take(chunk(0, " b", [12, 224, 176]), False)   # " b" and two of the emoji's three bytes
    assert st.merged == 3 and st.ids == [11, 12, 224, 176]
    whole = st.continuation_body("m")
    st.back = 2   # (what .seam found)
    body = st.continuation_body("m")
    assert body["prompt"] == [1, 2, 11, 12] and body["max_tokens"] == 7 and body["min_tokens"] == 3
    assert whole["prompt"] == [1, 2, 11, 12, 224, 176] and whole["max_tokens"] == 5 and body["seed"] != whole["seed"]
    st.cut()
    assert st.ids == [11, 12] and st.resent == [224, 176] and st.back == 0 and st.merged == 0
    again = [224, 176] if same else [224, 99]
    shown += st.take(chunk(0, "", again[:1], rid="cmpl-b"), True)   # (text-less: held with the pending)
    shown += st.take(chunk(0, "", again[1:], rid="cmpl-b"), True)
    shown += st.take(chunk(0, " 🦙" if same else " c", [257], rid="cmpl-b"), True)
    shown += st.take(chunk(0, " d", [251], "length", rid="cmpl-b"), True) + st.ending()
    assert [c["choices"][0]["text"] for c in shown] == [" a", " b", " 🦙" if same else " c", " d"]
    seen = [i for c in shown for i in c["choices"][0]["token_ids"]]
    assert seen == ([11, 12, 224, 176, 257, 251] if same else [11, 12, 224, 176, 99, 257, 251])
    assert st.ids == [11, 12, *again, 257, 251] and st.usage()["completion_tokens"] == 6 and st.resent == []


def test_new_tokens_after_a_merged_event_clear_the_cut_found_for_it():
    """A draining replica's stream goes on while no replica takes the rest: what .seam found for the last event
    no longer holds once more tokens came."""
    spec, _ = plan("/v1/chat/completions", {"model": "m", "messages": [], "stream": True}, M)
    st = Stitch(spec)
    ev = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
          "choices": [{"index": 0, "delta": {"role": "assistant", "content": " a b"}, "token_ids": [11, 12, 224],
                       "finish_reason": None}]}
    st.take(ev, False)
    assert st.merged == 3
    st.back = 1
    st.take({**ev, "choices": [{"index": 0, "delta": {"content": "🦙"}, "token_ids": [176, 257],
                                "finish_reason": None}]}, False)
    assert st.back == 0 and st.merged == 2 and st.continuation_body("m")["prompt"] == [1, 2, 11, 12, 224, 176, 257]
    st.take({**ev, "choices": [{"index": 0, "delta": {"content": " c"}, "token_ids": [13], "finish_reason": None}]},
            False)
    assert st.merged == 0
    # tokens without text after a merged event (half a character more) leave the cut to be looked at: they are
    # dropped at the cut, and the merged event's last ids may still be half a character
    st.take({**ev, "choices": [{"index": 0, "delta": {"content": " d"}, "token_ids": [14, 240, 159],
                                "finish_reason": None}]}, False)
    st.back = 1
    st.take({**ev, "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [166], "finish_reason": None}]},
            False)
    assert st.merged == 3 and st.back == 1 and st.pending == [166]


@pytest.mark.parametrize("chat", [False, True])
def test_the_prompts_ids_reach_the_client_when_the_chunk_that_carried_them_was_cut(chat):
    """The first token, half a character, held with the prompt's ids its chunk carried: a break there dropped both,
    and a continuation's chunks carry none, so a client that asked for token ids never got the prompt's."""
    body = {"model": "m", "stream": True, "return_token_ids": True, "max_tokens": 9,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    spec, _ = plan("/v1/chat/completions" if chat else "/v1/completions", body, M)
    st = Stitch(spec)
    if chat:
        first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [224],
                              "finish_reason": None}]}
    else:
        first = chunk(0, "", [224], prompt_ids=[1, 2])
    assert st.take(first, False) == []   # (held: half a character)
    st.cut()   # the replica dies; the next one makes the character again
    shown = st.take(chunk(0, " \U0001f999", [224, 176], rid="cmpl-b"), True)
    shown += st.take(chunk(0, " a", [11], "length", rid="cmpl-b"), True) + st.ending()
    if chat:
        assert shown[0]["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in shown[1]
        assert shown[0]["choices"][0]["delta"]["role"] == "assistant"
    else:
        assert shown[0]["choices"][0]["prompt_token_ids"] == [1, 2] and "prompt_token_ids" not in shown[1]["choices"][0]
    assert [c["choices"][0]["token_ids"] for c in shown] == [[224, 176], [11]]


def test_an_abort_after_half_a_character_drops_its_tokens_from_the_continuation():
    spec, _ = plan("/v1/chat/completions", {"model": "m", "messages": [], "stream": True}, M)
    st = Stitch(spec)
    st.take({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": " a"}, "token_ids": [11],
                          "finish_reason": None}]}, False)
    shown = st.take({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": ""}, "token_ids": [224], "finish_reason": None}]}, False)
    shown += st.take({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": ""}, "token_ids": [176], "finish_reason": "abort"}]}, False)
    assert shown == [] and st.aborted and st.continuation_body("m")["prompt"] == [1, 2, 11]


def test_a_first_chunk_of_half_a_character_keeps_what_it_carried_for_the_client():
    """The generation's first token is part of a character: its chunk (with the prompt's token ids a client with
    return_token_ids gets once) waits, and what it carried comes with the chunk that completes the character."""
    spec, _ = plan("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True,
                                       "return_token_ids": True}, M)
    st = Stitch(spec)
    assert st.take(chunk(0, "", [224], prompt_ids=[1, 2]), False) == []
    shown = st.take(chunk(0, "\U0001f999", [176]), False)
    assert [(c["choices"][0]["text"], c["choices"][0]["token_ids"], c["choices"][0].get("prompt_token_ids"))
            for c in shown] == [("\U0001f999", [224, 176], [1, 2])]
    chat, _ = plan("/v1/chat/completions", {"model": "m", "messages": [], "stream": True}, M)
    st = Stitch(chat)
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [224],
                          "finish_reason": None}]}
    assert st.take(first, False) == []
    shown = st.take({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "\U0001f999"}, "token_ids": [176], "finish_reason": None}]}, False)
    assert [c["choices"][0]["delta"] for c in shown] == [{"role": "assistant", "content": "\U0001f999"}]
