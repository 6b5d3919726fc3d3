"""LoRA adapters: a model's ``lora_adapters`` reach its job (``--enable-lora --lora-modules NAME=PATH``), and a
request naming one goes to that model's replicas as it came, the engine applying the adapter (an alias is
renamed to the served name, an adapter never): through the gateway and real simulator processes, with the
openai SDK as the client."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import openai
import pytest

from conftest import ROOT, metric_sum
from gateway_harness import Harness, Sim
from orchestrator.devtools.simulator import lora_module
from orchestrator.fleet.render import engine_argv, head_argv, run_batch_argv
from orchestrator.fleetfile import load_config_text
from orchestrator.yamlsrc import ConfigError

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    aliases: [m-alias]
    lora_adapters: {sql: /loras/sql, chat-v2: /loras/chat-v2}
  - name: other
    engine: simulator
    container: {enabled: false}
"""
PROMPT = "once upon a time " * 24   # several full blocks of 16 tokens


def test_a_request_naming_an_adapter_reaches_the_models_replica_as_it_came(tmp_path):
    h = Harness(tmp_path, MODELS)
    sim = Sim("r0", "--enable-lora", "--lora-modules", "sql=/loras/sql", "chat-v2=/loras/chat-v2")
    try:
        h.route_to([sim])
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="x", max_retries=0, timeout=30)

        def ask(model: str):
            r = c.completions.create(model=model, prompt="tell me", max_tokens=12, temperature=0)
            return r, json.loads(sim.get("/sim/last_body"))["model"]

        (base, to_base), (sql, to_sql), (v2, to_v2), (alias, to_alias) = (
            ask(n) for n in ("m", "sql", "chat-v2", "m-alias"))
        assert (to_base, to_sql, to_v2, to_alias) == ("m", "sql", "chat-v2", "m")   # what the replica was asked
        assert (base.model, sql.model, v2.model, alias.model) == ("m", "sql", "chat-v2", "m")
        texts = [r.choices[0].text for r in (base, sql, v2)]
        assert len(set(texts)) == 3 and alias.choices[0].text == texts[0]   # each adapter its own weights
        chat = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "sql"
        # listed as vLLM lists them: the adapter's parent is the model it runs on
        cards = {x.id: x for x in c.models.list().data}
        assert set(cards) == {"m", "m-alias", "sql", "chat-v2", "other"}
        assert cards["sql"].model_extra["parent"] == cards["chat-v2"].model_extra["parent"] == "m"
        assert "parent" not in cards["m-alias"].model_extra
        assert c.models.retrieve("sql").model_extra["parent"] == "m"
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="nosuch", prompt="x", max_tokens=1)
        assert e.value.code == "model_not_found"
    finally:
        h.close()
        sim.stop()


def test_an_adapters_stream_whose_replica_dies_goes_on_with_the_adapter(tmp_path):
    """A generation continued on another replica (its own died) is continued by the same adapter: the stitched
    text equals the adapter's uninterrupted one, not the base model's."""
    lora = ("--enable-lora", "--lora-modules", "sql=/loras/sql")
    fast = Sim("ref", "--tokens-per-s", "100000", *lora)
    h = Harness(tmp_path, MODELS)
    sims = [Sim(f"r{i}", "--tokens-per-s", "40", *lora) for i in range(2)]
    try:
        h.route_to(sims)
        greedy = dict(prompt="once upon a time", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
        ref = openai.OpenAI(base_url=fast.url + "/v1", api_key=fast.secret, max_retries=0, timeout=30)
        want, base = (ref.completions.create(model=n, **greedy).choices[0].text for n in ("sql", "m"))
        assert want != base
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="x", max_retries=0, timeout=60)
        pieces, killed = [], None
        for i, ch in enumerate(c.completions.create(model="sql", stream=True, **greedy)):
            pieces.append(ch.choices[0].text if ch.choices else "")
            if i == 10 and killed is None:
                killed = next(s for s in sims if s.metric("vllm:num_requests_running") > 0)
                os.kill(killed.proc.pid, signal.SIGKILL)
        assert killed is not None and "".join(pieces) == want
        assert h.metric("slurmfleet_stream_migrations_total", model="m", cause="reset", outcome="ok") == 1
    finally:
        h.close()
        for s in (fast, *sims):
            s.stop()


def test_an_adapters_blocks_are_its_own_in_the_simulators_prefix_cache():
    """vLLM hashes a LoRA request's blocks with the adapter as extra keys: the same prompt through the base model
    and through an adapter share no cached block, and each hits its own the second time."""
    sim = Sim("r0", "--enable-lora", "--lora-modules", "sql=/loras/sql")
    try:
        c = openai.OpenAI(base_url=sim.url + "/v1", api_key=sim.secret, max_retries=0, timeout=30)

        def hits_after(model: str) -> float:
            c.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0)
            return metric_sum(sim.get("/metrics").decode(), "vllm:prefix_cache_hits_total")

        first = hits_after("m")
        again = hits_after("m")
        assert first == 0 and again > 0
        assert hits_after("sql") == again             # the adapter's first: none of the base model's blocks
        assert hits_after("sql") == 2 * again         # its second: its own
    finally:
        sim.stop()


def test_adapters_reach_every_engine_command_line_and_the_head_alone_lists_them():
    cfg = load_config_text("""\
fleet: t
state_dir: /tmp/x
models:
  - {name: one, model_path: /m, container: {image: /i.sif}, lora_adapters: {sql: /loras/s q}}
  - {name: two, model_path: /m, container: {image: /i.sif}, nodes: 2, pipeline_parallel_size: 2,
     vllm_args: {distributed-executor-backend: mp}, lora_adapters: {sql2: /loras/sql}}
  - {name: sim, engine: simulator, container: {enabled: false}, lora_adapters: {a: /a}}
""", "t.yaml", {})
    one, two, sim = cfg.models
    assert engine_argv(one)[-3:] == ["--enable-lora", "--lora-modules", "sql=/loras/s q"]   # (one word each)
    assert "--enable-lora" in engine_argv(two) and "--lora-modules" not in engine_argv(two)   # every rank
    assert head_argv(two)[:2] == ["--lora-modules", "sql2=/loras/sql"]                       # the HTTP server's
    assert run_batch_argv(one)[-3:] == ["--enable-lora", "--lora-modules", "sql=/loras/s q"]
    assert "a=/a" in engine_argv(sim) and "a=/a" in run_batch_argv(sim)
    plain = cfg.models[0].model_copy(update={"lora_adapters": {}})
    assert "--enable-lora" not in engine_argv(plain)


# vLLM's own parser of --lora-modules (its LoRAParserAction, as vllm serve and vllm run-batch use it)
VLLM_LORA_PARSE = """\
import argparse, json, sys
from vllm.entrypoints.launchers.cli_args import LoRAParserAction
p = argparse.ArgumentParser()
p.add_argument("--lora-modules", nargs="+", action=LoRAParserAction)
print(json.dumps([[m.name, m.path] for m in p.parse_args(sys.argv[1:]).lora_modules]))
"""


def test_an_adapter_path_with_a_comma_or_an_equals_sign_reaches_the_engine_whole():
    """vLLM reads a ``--lora-modules`` item holding a ``,`` as JSON: ``sql=/loras/sql,v2`` failed every start of
    the engine (and of ``run-batch``), which the file's validation had passed; such an item is vLLM's JSON form,
    which the simulator takes too (a ``=`` in a path is read whole either way: NAME is split at the first)."""
    cfg = load_config_text("""\
fleet: t
state_dir: /tmp/x
models:
  - {name: m, model_path: /m, container: {image: /i.sif}, lora_adapters: {sql: "/loras/sql,v2", chat: /l/a=b}}
  - {name: sim, engine: simulator, container: {enabled: false}, lora_adapters: {sql2: "/l/s,v2", chat2: /l/a=b}}
""", "t.yaml", {})
    m, sim = cfg.models
    want = [["sql", "/loras/sql,v2"], ["chat", "/l/a=b"]]
    items = engine_argv(m)[engine_argv(m).index("--lora-modules") + 1:]
    assert items == ['{"name": "sql", "path": "/loras/sql,v2"}', "chat=/l/a=b"]
    assert run_batch_argv(m)[-2:] == items
    for argv in (engine_argv(sim), run_batch_argv(sim)):
        at = argv.index("--lora-modules")
        assert [list(lora_module(i)) for i in argv[at + 1:at + 3]] == [["sql2", "/l/s,v2"], ["chat2", "/l/a=b"]]
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if python.exists():   # (.ci/setup-vllm)
        out = subprocess.run([str(python), "-c", VLLM_LORA_PARSE, "--lora-modules", *items], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1]) == want, out.stderr[-2000:]


@pytest.mark.parametrize("extra, field, says", [
    ("    lora_adapters: {other: /l}\n", "lora_adapters.other",
     "served name, alias or LoRA adapter 'other' of model 'm' is already used by model 'other'"),
    ("    lora_adapters: {x: /l}\n    vllm_args: {lora-modules: x=/l}\n", "vllm_args.lora-modules",
     "list the adapters in lora_adapters"),
    ("    lora_adapters: {x: /l}\n    routing: kv_aware\n    model_path: /m\n", "routing",
     "routing kv_aware with lora_adapters"),
    ("    lora_adapters: {x: -l}\n", "lora_adapters.x", "starts with '-'"),
    ("    lora_adapters: {'x y': /l}\n", "lora_adapters.x y", "'x y' is not allowed: a name of letters, digits"),
])
def test_adapters_that_could_not_be_served_are_told_at_their_field(extra, field, says):
    text = ("fleet: t\nstate_dir: /tmp/x\nmodels:\n  - name: other\n    engine: simulator\n    container: "
            "{enabled: false}\n  - name: m\n    engine: simulator\n    container: {enabled: false}\n" + extra)
    with pytest.raises(ConfigError) as e:
        load_config_text(text, "f.yaml", {})
    assert f"models[1].{field}" in str(e.value) and says in str(e.value), str(e.value)
