"""Fleet config: a table of bad configs with exact positioned errors, and what valid ones mean."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from orchestrator.config import ProbeConfig
from orchestrator.fleetfile import load_config, load_config_text
from orchestrator.timefmt import format_time_limit, parse_time_limit
from orchestrator.yamlsrc import ConfigError

BASE = """\
fleet: prod
state_dir: /shared/slurmfleet
models:
  - name: llama-8b
    engine: simulator
    container: {enabled: false}
"""


def problems(text: str, env: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_text(textwrap.dedent(text), "fleet.yaml", env or {})
    return [str(p) for p in info.value.problems]

TWO_NODES = """\
fleet: prod
state_dir: /s
models:
  - name: big
    model_path: /m
    container: {enabled: false}
    nodes: 2
    gpus_per_node: 8
    tensor_parallel_size: 8
"""

BAD = [
    ("unknown top-level key", BASE + "colour: blue\n", "fleet.yaml:7:1: colour: unknown field"),
    ("unknown model key", BASE + "    gpu_count: 4\n", "fleet.yaml:7:5: models[0].gpu_count: unknown field"),
    ("TP x PP mismatch", TWO_NODES + "    pipeline_parallel_size: 1\n", "fleet.yaml:9:27: models[0].tensor_parallel_size: tensor_parallel_size 8 x pipeline_parallel_size 1 = 8 GPUs must equal nodes x gpus_per_node = 2 x 8 = 16"),
    # vLLM's world is tensor x pipeline x prefill-context x data parallel: 32 GPUs on 16, every start failed
    ("data parallel beyond the GPUs", TWO_NODES + "    pipeline_parallel_size: 2\n    vllm_args: {data-parallel-size: 2}\n",
     "fleet.yaml:9:27: models[0].tensor_parallel_size: tensor_parallel_size 8 x pipeline_parallel_size 2 x vllm_args "
     "data-parallel-size 2 = 32 GPUs must equal nodes x gpus_per_node = 2 x 8 = 16"),
    ("prefill context parallel beyond the GPUs", TWO_NODES + "    pipeline_parallel_size: 2\n"
     "    vllm_args: {prefill-context-parallel-size: 2}\n",
     "fleet.yaml:9:27: models[0].tensor_parallel_size: tensor_parallel_size 8 x pipeline_parallel_size 2 x vllm_args "
     "prefill-context-parallel-size 2 = 32 GPUs must equal nodes x gpus_per_node = 2 x 8 = 16"),
    ("multi-node data parallel on Ray", TWO_NODES + "    vllm_args: {data-parallel-size: 2, data-parallel-backend: ray}\n",
     "fleet.yaml:10:63: models[0].vllm_args.data-parallel-backend: vllm_args data-parallel-backend 'ray' cannot run "
     "on 2 nodes"),
    ("a multi-node replica on Ray", TWO_NODES + "    pipeline_parallel_size: 2\n    vllm_args: {distributed-executor: ray}\n",
     "fleet.yaml:11:39: models[0].vllm_args.distributed-executor: vllm_args distributed-executor-backend 'ray' cannot run on 2 nodes"),
    ("bad time limit", BASE + "    time_limit: 4h\n", "fleet.yaml:7:17: models[0].time_limit: invalid SLURM time limit '4h'"),
    ("minutes over 59", BASE + "    time_limit: '1:75:00'\n", "fleet.yaml:7:17: models[0].time_limit: minutes must be below 60, got 75"),
    # 400 digits were an OverflowError traceback (float division); 5000000000 rendered a --time sbatch wraps (it adds
    # up seconds in a signed 32-bit int)
    ("time limit past sbatch's", BASE + "    time_limit: " + "9" * 400 + "\n",
     "fleet.yaml:7:17: models[0].time_limit: time limit must be at most 35791393 minutes (24855-03:13:00), the longest "
     "sbatch reads (a longer --time wraps); UNLIMITED sets none"),
    ("time limit in minutes past sbatch's", BASE + "    time_limit: 5000000000\n",
     "fleet.yaml:7:17: models[0].time_limit: time limit must be at most 35791393 minutes"),
    ("time limit in days past sbatch's", BASE + "    time_limit: 24855-03:14\n",
     "fleet.yaml:7:17: models[0].time_limit: time limit must be at most 35791393 minutes"),
    ("unset variable", BASE.replace("/shared/slurmfleet", "${SHARED}/sf"),
     "fleet.yaml:2:12: state_dir: environment variable SHARED is not set"),
    ("negative replicas", BASE + "    replicas: -1\n", "fleet.yaml:7:15: models[0].replicas: Input should be greater than or equal to 0"),
    ("duplicate served name", BASE + "  - name: llama-8b\n    engine: simulator\n    container: {enabled: false}\n",
     "fleet.yaml:7:11: models[1].name: model 'llama-8b' is defined twice"),   # (it said "'llama-8b' of model
    # 'llama-8b' is already used by model 'llama-8b'": a soak)
    ("alias clashes with a name", BASE + "  - name: other\n    aliases: [llama-8b]\n    engine: simulator\n"
     "    container: {enabled: false}\n",
     "fleet.yaml:8:15: models[1].aliases[0]: served name, alias or LoRA adapter 'llama-8b' of model 'other' is already used by "
     "model 'llama-8b'"),
    ("hostile served name", BASE.replace("llama-8b", "'x; rm -rf ~'"),
     "fleet.yaml:4:11: models[0].name: 'x; rm -rf ~' is not allowed: a name of letters, digits and"),
    ("hostile partition", BASE + "    partition: 'gpu$(reboot)'\n", "fleet.yaml:7:16: models[0].partition: 'gpu$(reboot)' is not allowed: one SLURM word"),
    ("hostile sbatch option", BASE + "cluster:\n  sbatch_options:\n    mail-user: 'a b\n      c'\n",
     "fleet.yaml:9:16: cluster.sbatch_options.mail-user: sbatch option 'mail-user' value 'a b c' may not contain spaces"),
    ("sbatch option key ending in a newline", BASE + "cluster:\n  sbatch_options: {\"hold\\n\": true}\n",
     "sbatch option 'hold\\n' must be a long option name"),
    ("sbatch option value ending in a newline", BASE + "cluster:\n  sbatch_options: {mail-user: \"a@b\\n\"}\n",
     "sbatch option 'mail-user' value 'a@b\\n' may not contain spaces, quotes or newlines"),
    # sbatch's other spelling of --ntasks-per-node
    ("managed sbatch option's other spelling", BASE + "cluster:\n  sbatch_options: {tasks-per-node: 8}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.tasks-per-node: sbatch option 'tasks-per-node' is set by slurmfleet itself"),
    ("abbreviated other spelling of a managed sbatch option", BASE + "cluster:\n  sbatch_options: {tasks: 8}\n",
     "sbatch option 'tasks' abbreviates 'tasks-per-node'"),
    ("managed sbatch option", BASE + "cluster:\n  sbatch_options: {time: '1:00'}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.time: sbatch option 'time' is set by slurmfleet: use time_limit"),
    ("managed vllm flag", BASE + "    vllm_args: {port: 9000}\n", "fleet.yaml:7:23: models[0].vllm_args.port: --port is set by slurmfleet itself"),
    # sbatch and vLLM's argparse take an unambiguous start of a long option as the option
    ("abbreviated managed sbatch option", BASE + "cluster:\n  sbatch_options: {comm: x}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.comm: sbatch option 'comm' abbreviates 'comment'"),
    ("abbreviated forbidden sbatch option", BASE + "cluster:\n  sbatch_options: {arr: 0-3}\n",
     "sbatch option 'arr' abbreviates 'array'"),
    # a job on another cluster: squeue and scancel without -M never list it, so it was submitted again and again
    ("sbatch option sending the job to another cluster", BASE + "cluster:\n  sbatch_options: {clusters: other}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.clusters: sbatch option 'clusters' would change what a replica's job is"),
    ("federation's cluster constraint", BASE + "cluster:\n  sbatch_options: {cluster-constraint: other}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.cluster-constraint: sbatch option 'cluster-constraint' would change"),
    ("abbreviated clusters option", BASE + "cluster:\n  sbatch_options: {cluster: other}\n",
     "sbatch option 'cluster' abbreviates 'cluster-constraint'"),
    ("short clusters option", BASE + "cluster:\n  sbatch_options: {M: other}\n", "sbatch option 'M' must be a long option"),
    ("sbatch option that submits no job", BASE + "cluster:\n  sbatch_options: {version: true}\n",
     "sbatch option 'version' would change"),
    # a bare #SBATCH --mail-user took the next line as its value: sbatch read mail-user=--exclusive, no --exclusive
    ("true on an sbatch option that needs a value", BASE + "cluster:\n  sbatch_options:\n    mail-user: true\n"
     "    exclusive: true\n", "fleet.yaml:9:5: cluster.sbatch_options.mail-user: sbatch option 'mail-user' needs a "
     "value: true writes a bare --mail-user, and sbatch would take the next #SBATCH line as its value"),
    ("true on a start of an sbatch option that needs a value", BASE + "cluster:\n  sbatch_options: {mail-t: true}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.mail-t: sbatch option 'mail-t' (a start of 'mail-type') needs a value"),
    ("true on an sbatch option not known to take none", BASE + "cluster:\n  sbatch_options: {tres-per-task: true}\n",
     "sbatch option 'tres-per-task' is none that takes no value"),
    ("a secret on the engine's command line", BASE + "    vllm_args: {hf-token: hf_abc}\n",
     "fleet.yaml:7:27: models[0].vllm_args.hf-token: --hf-token would put a secret on the engine's command line, "
     "which every user of its node sees in `ps`: set env HF_TOKEN instead"),
    ("abbreviated managed vllm flag", BASE + "    vllm_args: {api-k: zzz}\n",
     "fleet.yaml:7:24: models[0].vllm_args.api-k: --api-key (which 'api-k' abbreviates) is set by the job's own secret"),
    # each value is a word of its own after --key: a leading '-' made it an option of vLLM's, past the check of the
    # keys (after an on/off flag: --enable-prefix-caching --served-model-name=evil)
    ("vllm_args value read as an option", BASE + '    vllm_args: {enable-prefix-caching: "--served-model-name=evil"}\n',
     "fleet.yaml:7:40: models[0].vllm_args.enable-prefix-caching: '--served-model-name=evil' starts with '-', which "
     "vLLM would read as an option of its own, not as this flag's value (a negative number such as -1 or -0.5 is fine)"),
    ("vllm_args list item read as an option", BASE + '    vllm_args: {lora-modules: [a=/l, "--api-key=k"]}\n',
     "fleet.yaml:7:31: models[0].vllm_args.lora-modules: '--api-key=k' starts with '-'"),
    # a leading '-' made these options of vllm/apptainer/python3 (shlex.quote keeps the word), past the check of
    # the flags slurmfleet sets itself
    ("model path read as an option", BASE + "    model_path: --api-key=abc\n",
     "fleet.yaml:7:17: models[0].model_path: '--api-key=abc' starts with '-', which the engine's or apptainer's "
     "command line would read as an option"),
    ("image and bind read as options",
     BASE.replace("container: {enabled: false}", "container: {image: -i.sif, binds: [/d:/d, --writable]}"),
     "fleet.yaml:6:24: models[0].container.image: '-i.sif' starts with '-'"),
    ("bind read as an option",
     BASE.replace("container: {enabled: false}", "container: {image: /i.sif, binds: [/d:/d, --writable]}"),
     "fleet.yaml:6:47: models[0].container.binds[1]: '--writable' starts with '-'"),
    ("exporter path read as an option", BASE + "    gpu_metrics: {container_path: -c}\n",
     "fleet.yaml:7:35: models[0].gpu_metrics.container_path: '-c' starts with '-'"),
    ("apptainer command read as an option",   # (setsid's or bash exec's option, not apptainer)
     BASE.replace("container: {enabled: false}", "container: {image: /i.sif, apptainer: -c}"),
     "fleet.yaml:6:43: models[0].container.apptainer: '-c' starts with '-'"),
    # SLURM's USR1 (drain.signal_lead_s before the limit) hands a replica over: 120 s before a 2 min limit is at start
    ("time limit warning at the job's start", BASE + "    time_limit: 2\n",
     "fleet.yaml:7:17: models[0].time_limit: drain.signal_lead_s = 120 s must be below 60 s, half the shortest time limit of this "
     "model's jobs (time_limit = 120 s): SLURM's USR1 that early would hand every replica over as soon as it is ready"),
    ("time limit warning before a staggered slot's half", BASE + "    time_limit: 8\n    drain: {stagger_s: 60}\n",
     "fleet.yaml:8:24: models[0].drain.stagger_s: drain.signal_lead_s = 120 s must be below 120 s, half the shortest time limit of this "
     "model's jobs (time_limit = 480 s, shortened by drain.stagger_s to as little as half of it)"),
    ("the replica's secret in env", BASE + "    env: {VLLM_API_KEY: k}\n",
     "fleet.yaml:7:11: models[0].env.VLLM_API_KEY: VLLM_API_KEY is the job's own"),
    ("a job variable in env", BASE + "    env: {SF_RECORD: /x}\n", "SF_RECORD is the job's own"),
    # the job script (bash) exports the model's env: a read-only one failed (job log: 'UID: readonly variable') and
    # the engine got bash's value, as it did of one bash sets itself
    ("a read-only bash variable in env", BASE + "    env: {UID: '5'}\n",
     "fleet.yaml:7:11: models[0].env.UID: UID is one of bash's own variables (read-only, or set by bash itself): the job "
     "script, a bash script, cannot export it, so the engine would get bash's value"),
    ("a variable bash sets in env", BASE + "    env: {RANDOM: '4'}\n", "fleet.yaml:7:11: models[0].env.RANDOM: RANDOM is one of bash's own"),
    ("a BASH_ variable in env", BASE + "    env: {BASH_COMMAND: x}\n", "BASH_COMMAND is one of bash's own"),
    # Linux caps one argument or environment string at 128 KiB in bytes: 50,000 x '✓' (150,000 bytes) passed as
    # 50,000 characters, and the engine's start failed with 'Argument list too long'
    ("a value over the limit in bytes", BASE + "    env: {A: " + "✓" * 50_000 + "}\n",
     "fleet.yaml:7:14: models[0].env.A: is 150000 bytes long in UTF-8; at most 65536"),
    ("a lone surrogate in env", BASE + "    env: {A: \"\\ud800x\"}\n",   # (validate passed it; render raised)
     "fleet.yaml:7:14: models[0].env.A: holds a lone surrogate"),
    ("a carriage return in env", BASE + "    env: {A: \"x\\r\\ny\"}\n",
     "fleet.yaml:7:14: models[0].env.A: contains a carriage return, which no job script can hold"),
    ("state dir Apptainer's binds would split", BASE.replace("/shared/slurmfleet", "/shared/a:b,c"),
     "fleet.yaml:2:12: state_dir: '/shared/a:b,c' is not allowed: an absolute path without spaces"),
    ("vllm without model path", BASE.replace("engine: simulator", "engine: vllm"),
     "fleet.yaml:5:13: models[0].engine: model_path is required for engine vllm"),
    ("container without image", BASE.replace("engine: simulator", "engine: vllm\n    model_path: /m").replace(
        "container: {enabled: false}", "container: {}"),
     "fleet.yaml:7:16: models[0].container: container.image is required when container.enabled is true"),
    # the simulator runs the host's python (the daemon's): no image has it, and every start failed
    ("simulator in a container", BASE.replace("container: {enabled: false}", "container: {image: /i.sif}"),
     "fleet.yaml:6:16: models[0].container: engine simulator runs the daemon's own Python on the node, not in an "
     "image: set container: {enabled: false}"),
    ("bad memory", BASE + "    memory: lots\n", "fleet.yaml:7:13: models[0].memory: invalid memory 'lots'"),
    ("bad routing policy", BASE + "    routing: random\n", "fleet.yaml:7:14: models[0].routing: unknown routing policy 'random'; one of: kv_aware, least_outstanding, load_aware"),
    ("duplicate key", BASE + "    engine: vllm\n", "fleet.yaml:7:5: models[0].engine: duplicate key"),
    ("yaml syntax", BASE + "  - name: [unclosed\n", "fleet.yaml:8:"),
    ("bad default", BASE + "defaults:\n  replica: 2\n", "fleet.yaml:8:3: defaults.replica: unknown field"),
    ("workers on port 0", BASE + "gateway: {port: 0, workers: 2}\n",
     "fleet.yaml:7:17: gateway.port: gateway.workers > 1 needs a fixed port"),
    ("kv_aware with a tokenizer it cannot follow", BASE + "    routing: kv_aware\n    vllm_args: {tokenizer-mode: mistral, "
     "chat-template-content-format: openai, chat-template: /t.jinja}\n", "fleet.yaml:8:72: models[0].vllm_args.chat-template-content-format: vllm_args "
     "chat-template-content-format, tokenizer-mode change how the engine tokenizes prompts, which routing kv_aware "
     "cannot follow"),
    # vLLM publishes the events of data-parallel ranks past 0 only on tcp endpoints: on the job's ipc ones they
    # failed to start (kv_events.offset_endpoint_port), and the replica never turned READY
    ("kv_aware with data parallelism", BASE + "    gpus_per_node: 2\n    routing: kv_aware\n"
     "    vllm_args: {data-parallel-size: 2}\n", "fleet.yaml:9:37: models[0].vllm_args.data-parallel-size: vllm_args "
     "data-parallel-size 2 with routing kv_aware: each rank keeps a cache of its own"),
    ("relative state dir", BASE.replace("/shared/slurmfleet", "shared"), "fleet.yaml:2:12: state_dir: 'shared' is not allowed: an absolute path without spaces"),
    ("state dir sbatch would expand", BASE.replace("/shared/slurmfleet", "/shared/%u"),
     "fleet.yaml:2:12: state_dir: '/shared/%u' is not allowed: an absolute path without spaces"),
    # sbatch reads an unquoted '#' in an #SBATCH line as a comment: --output=/shared/a#b/... was cut at the '#'
    ("state dir sbatch would cut", BASE.replace("/shared/slurmfleet", "/shared/a#b"),
     "fleet.yaml:2:12: state_dir: '/shared/a#b' is not allowed: an absolute path without spaces"),
    # pydantic's lax mode read false as 0 GPUs: with TP 2 on 2 nodes a vLLM job asked for no GPU at all
    ("boolean gpus", BASE + "    gpus_per_node: false\n", "fleet.yaml:7:20: models[0].gpus_per_node: gpus_per_node must be a "
     "number, not false"),
    ("boolean replicas", BASE + "    replicas: true\n", "fleet.yaml:7:15: models[0].replicas: replicas must be a number"),
    ("boolean rpm", BASE + "gateway:\n  api_keys:\n    - {name: a, key: sk-aaaa, rpm: true}\n",   # (PositiveInt | None)
     "fleet.yaml:9:36: gateway.api_keys[0].rpm: rpm must be a number, not true"),
    ("cpus sbatch cannot take", BASE + "    cpus_per_task: 99999999999999999999999\n",
     "fleet.yaml:7:20: models[0].cpus_per_task: Input should be less than or equal to 65536"),
    ("memory sbatch cannot take", BASE + "    memory: 99999999999999999999T\n",
     "fleet.yaml:7:13: models[0].memory: memory '99999999999999999999T' is more than a node has"),
    # sbatch: "--cpus-per-gpu is mutually exclusive with --cpus-per-task" (always written): every sbatch failed
    ("sbatch option exclusive with a written one", BASE + "cluster:\n  sbatch_options: {cpus-per-gpu: 4}\n",
     "fleet.yaml:8:20: cluster.sbatch_options.cpus-per-gpu: sbatch option 'cpus-per-gpu' is set by slurmfleet itself"),
    ("mem-per-gpu beside memory", BASE + "    memory: 64G\ncluster:\n  sbatch_options: {mem-per-gpu: 16G}\n",
     "fleet.yaml:7:13: models[0].memory: memory (--mem) and cluster.sbatch_options mem-per-gpu exclude each other"),
    # an admin key that can never match locked the admin API (and no admin.key was made, a key being set)
    ("admin key not hex", BASE + "daemon: {admin_api_keys: ['sha256:not-hex']}\n",
     "fleet.yaml:7:27: daemon.admin_api_keys[0]: sha256: must be followed by the 64 hex digits"),
    ("empty metrics key", BASE + "daemon: {metrics_api_keys: ['']}\n", "fleet.yaml:7:29: daemon.metrics_api_keys[0]: a key "
     "may not be empty"),
    ("client key with spaces", BASE + "gateway: {api_keys: [' abc ']}\n",
     "fleet.yaml:7:22: gateway.api_keys[0]: a key may not start or end with spaces"),
    # (anything but lowercase sha256: was a plain key: the digest's own text opened it, the key did not)
    ("digest prefix spelt otherwise", BASE + "gateway: {api_keys: ['SHA256:" + "ab" * 32 + "']}\n",
     "fleet.yaml:7:22: gateway.api_keys[0]: a key's digest is written sha256:<hex>, in lowercase"),
    ("digest prefix with a dash", BASE + "gateway: {api_keys: [{key: 'sha-256:" + "ab" * 32 + "'}]}\n",
     "a key's digest is written sha256:<hex>, in lowercase"),
    ("state dir /", BASE.replace("/shared/slurmfleet", "/"), "fleet.yaml:2:12: state_dir: '/' is not allowed: an absolute path without spaces"),
    # the composer and the builder recurse: 600 levels were a RecursionError, not a position
    ("nested too deep", BASE + "    x: " + "[" * 600 + "]" * 600 + "\n",
     "fleet.yaml:7:69: <root>: mappings and lists nested more than 64 deep"),
    # (each alias expands what its anchor names: 12 lines of 60 deep made a RecursionError again)
    ("nested too deep through aliases", BASE + "x0: &a0 " + "[" * 60 + "1" + "]" * 60 + "\n" + "".join(
        f"x{k}: &a{k} " + "[" * 60 + f"*a{k - 1}" + "]" * 60 + "\n" for k in range(1, 12)),
     "fleet.yaml:8:69: <root>: mappings and lists nested more than 64 deep"),
    ("bind_host", BASE + '    bind_host: "0.0.0.0\\r"\n', "fleet.yaml:7:16: models[0].bind_host: '0.0.0.0\\r' is not allowed: an address or a host name"),
]


@pytest.mark.parametrize("case,text,expected", BAD, ids=[c[0] for c in BAD])
def test_bad_config_reports_file_line_and_field(case, text, expected):
    got = problems(text)
    assert any(p.startswith(expected) or (expected in p and not expected.startswith("fleet.yaml")) for p in got), got


CR_CONTAINER = BASE.replace("container: {enabled: false}",   # (off: the simulator runs in no image)
                            'container: {enabled: false, image: "/i\\r.sif", binds: ["/d:/d\\r"], extra_args: ["--x\\r"]}')


@pytest.mark.parametrize("text,where", [
    (BASE + '    model_path: "/m\\r\\n"\n', ["7:17: models[0].model_path"]),
    (CR_CONTAINER, ["6:40: models[0].container.image", "6:60: models[0].container.binds[0]",
                    "6:85: models[0].container.extra_args[0]"]),
    (BASE + '    simulator: {extra_args: ["a\\rb"]}\n', ["7:30: models[0].simulator.extra_args[0]"]),
    (BASE + '    gpu_metrics: {container_path: "/e.py\\r"}\n', ["7:35: models[0].gpu_metrics.container_path"]),
    (BASE + '    vllm_args: {chat-template: "x\\r"}\n', ["7:32: models[0].vllm_args.chat-template"]),
    (BASE + 'defaults:\n  model_path: "/m\\r"\n', ["8:15: defaults.model_path"]),
], ids=["model_path", "container", "simulator.extra_args", "gpu_metrics", "vllm_args", "defaults"])
def test_a_carriage_return_is_refused_in_every_value_where_it_is(text, where):
    """Every value a job uses is written into its script, which sbatch refuses with a DOS line break: found
    here, at its line, not at submit time (it was checked in env and vllm_args only)."""
    got = problems(text)
    assert got == [f"fleet.yaml:{w}: contains a carriage return, which no job script can hold (sbatch refuses DOS "
                   "line breaks)" for w in where], got


def test_every_problem_is_reported_at_once():
    text = BASE + "    replicas: -2\n    time_limit: soon\n    colour: red\n"
    got = problems(text)
    assert len(got) == 3, got
    assert [p.split(":")[1] for p in got] == ["7", "8", "9"]


def test_every_bad_sbatch_option_and_env_name_is_reported_at_its_own_key():
    """Each bad key of ``cluster.sbatch_options`` and of a model's ``env`` is its own problem at its own line (they
    were one problem at the mapping's first line, and only the first bad key was told)."""
    text = BASE + ("    env:\n      HOME: /x\n      SF_X: y\n      UID: '3'\n"
                   "cluster:\n  sbatch_options:\n    mail-type: FAIL\n    array: 1-3\n    time: 10\n"
                   "    mail-user: 'a b'\n")
    assert problems(text) == [
        "fleet.yaml:9:7: models[0].env.SF_X: SF_X is the job's own (the replica's secret, slurmfleet's, SLURM's or "
        "Apptainer's variables): it cannot be set here",
        "fleet.yaml:10:7: models[0].env.UID: UID is one of bash's own variables (read-only, or set by bash itself): the "
        "job script, a bash script, cannot export it, so the engine would get bash's value",
        "fleet.yaml:14:5: cluster.sbatch_options.array: sbatch option 'array' would change what a replica's job is; it "
        "is not allowed",
        "fleet.yaml:15:5: cluster.sbatch_options.time: sbatch option 'time' is set by slurmfleet: use time_limit",
        "fleet.yaml:16:16: cluster.sbatch_options.mail-user: sbatch option 'mail-user' value 'a b' may not contain "
        "spaces, quotes or newlines"]


def test_true_renders_a_bare_flag_of_the_sbatch_options_that_take_no_value():
    """``true`` is kept for the options sbatch takes without a value (or with an optional one), a start of one too."""
    flags = {"exclusive": True, "overcommit": True, "contiguous": True, "spread-job": True, "use-min-nodes": True,
             "oversubscribe": True, "nice": True, "propagate": True, "ignore-pbs": True, "spread": True}
    text = BASE + "cluster:\n  sbatch_options: {" + ", ".join(f"{k}: true" for k in flags) + ", mail-type: FAIL}\n"
    assert load_config_text(text, "f", {}).cluster.sbatch_options == {**flags, "mail-type": "FAIL"}


def test_line_breaks_editors_do_not_show_are_refused_where_editors_put_them():
    """YAML 1.1 reads U+2028, U+2029 and U+0085 as line breaks, which editors and grep do not: a comment's end was
    live config (this set gateway.host), and every later line PyYAML reported was off by one per character."""
    text = BASE + "gateway:\n  port: 8000   # was 9000\u2028  host: 0.0.0.0\n# a\u2029b\x85c\n"
    why = ("YAML reads it as a line break, which editors and grep do not show (what follows it on this line is read "
           "as a line of its own, even after a #); remove it, or write it as \\u{} in a double-quoted string")
    assert problems(text) == ["fleet.yaml:8:26: <root>: U+2028 LINE SEPARATOR: " + why.format("2028"),
                              "fleet.yaml:9:4: <root>: U+2029 PARAGRAPH SEPARATOR: " + why.format("2029"),
                              "fleet.yaml:9:6: <root>: U+0085 NEXT LINE: " + why.format("0085")]
    assert load_config_text(BASE + 'gateway:\n  port: 8000   # "\\u2028" escaped\n', "f", {}).gateway.port == 8000
    # a carriage return alone (an old Mac's line end, a paste) too; a Windows file's CRLF is one break for both
    assert problems(BASE + "gateway:\n  port: 8000   # was 9000\r  host: 0.0.0.0\n") == [
        "fleet.yaml:8:26: <root>: a carriage return not before a line feed (U+000D): " + why.format("000d")]
    crlf = (BASE + "gateway:\n  port: 8000   # a comment\n").replace("\n", "\r\n")
    assert load_config_text(crlf, "f", {}).gateway.port == 8000


def test_defaults_merge_and_their_errors_point_at_defaults():
    cfg = load_config_text(BASE + "defaults:\n  replicas: 3\n  probe: {interval_s: 7}\n", "f.yaml", {})
    assert cfg.models[0].replicas == 3 and cfg.models[0].probe.interval_s == 7
    got = problems(BASE + "defaults:\n  replicas: -3\n")
    assert got[0].startswith("fleet.yaml:8:13: defaults.replicas"), got
    # a value from defaults is said once, at defaults (it was once per model, each at the model's path); a check
    # across fields stays the model's own
    many = BASE + "".join(f"  - name: m{i}\n    engine: simulator\n" for i in range(3))
    got = problems(many + "defaults:\n  probe: {intervall_s: 7}\n")
    assert got == ["fleet.yaml:14:11: defaults.probe.intervall_s: unknown field (did you mean 'interval_s'?)"], got
    # a misspelt key of defaults itself is said with the field it meant, as anywhere else; "name" is a model's own
    got = problems(many + "defaults:\n  gpus_per_nod: 2\n  name: x\n")
    assert got == ["fleet.yaml:14:3: defaults.gpus_per_nod: unknown field (did you mean 'gpus_per_node'?)",
                   "fleet.yaml:15:3: defaults.name: unknown field (or not allowed in defaults)"], got
    got = problems(many + "defaults:\n  gpu_type: a100\n  gpus_per_node: 0\n")
    assert sum(p.startswith("fleet.yaml:14:13: models[") and "gpu_type needs" in p for p in got) == 4, got


def test_a_models_own_replicas_or_autoscale_wins_over_the_other_from_defaults():
    """replicas and autoscale exclude each other: a model that sets one is not refused for the other that defaults
    gives every model (it was: "replicas and autoscale exclude each other" at a model that set no replicas)."""
    text = BASE + ("    autoscale: {max_replicas: 3}\n  - name: fixed\n    engine: simulator\n"
                   "  - name: pinned\n    engine: simulator\n    replicas: 1\n")
    cfg = load_config_text(text + "defaults:\n  replicas: 2\n", "f.yaml", {})
    assert [(m.replicas if m.autoscale is None else None, m.autoscale and m.autoscale.max_replicas)
            for m in cfg.models] == [(None, 3), (2, None), (1, None)]
    cfg = load_config_text(text + "defaults:\n  autoscale: {max_replicas: 4}\n", "f.yaml", {})
    assert [(m.replicas if m.autoscale is None else None, m.autoscale and m.autoscale.max_replicas)
            for m in cfg.models] == [(None, 3), (None, 4), (1, None)]
    # one model setting both is still refused, at that model
    assert "exclude each other" in "".join(problems(BASE + "    replicas: 1\n    autoscale: {max_replicas: 3}\n"))


def test_an_unknown_key_in_defaults_hides_no_other_problem_and_problems_come_in_file_order():
    """An unknown key in defaults was reported alone (the rest unchecked); and problems came in pydantic's
    order, not the file's. Found by a soak."""
    text = ("fleet: prod\nstate_dir: /s\ndefaults:\n  bogus: 1\n  replicas: many\nmodels:\n  - name: m\n"
            "    engine: simulator\n    cpus_per_task: x\n    colour: red\n")
    got = problems(text)
    assert [p.split(": ", 2)[1] for p in got] == ["defaults.bogus", "defaults.replicas", "models[0].cpus_per_task",
                                                  "models[0].colour"], got
    assert [int(p.split(":")[1]) for p in got] == [4, 5, 9, 10], got


def test_a_value_no_branch_of_a_union_takes_is_one_problem():
    """vllm_args takes a string, number, boolean or a list of those: a mapping was five problems, one per branch
    (vllm_args.a.str, .int, .float, .bool and the list). Found by a soak."""
    assert problems(BASE + "    vllm_args: {a: {b: c}, int: {b: c}}\n") == [
        "fleet.yaml:7:20: models[0].vllm_args.a: Input should be a valid string, integer, number, boolean or list",
        "fleet.yaml:7:33: models[0].vllm_args.int: Input should be a valid string, integer, number, boolean or list"]


def test_env_expansion_with_default_and_value():
    text = BASE.replace("/shared/slurmfleet", "${ROOT:-/scratch}/sf")
    assert load_config_text(text, "f", {}).state_dir == "/scratch/sf"
    assert load_config_text(text, "f", {"ROOT": "/lustre"}).state_dir == "/lustre/sf"


@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), (90, 5400), ("5:30", 330), ("2:00:00", 7200), ("1-0", 86400), ("1-02:30", 95400),
    ("2-00:00:01", 172801), ("UNLIMITED", None), ("infinite", None), (35791393, 2147483580),
    ("24855-03:13:00", 2147483580), ("24855-03:12:01", 2147483521),
])
def test_time_limit_formats(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "4h", "1:2:3:4", "-5", "1-25", "0", "1.5", "abc", "1-2-3", 35791394,
                                  "24855-03:13:01", "35791394", pytest.param(10**400, id="10**400")])
def test_time_limit_rejects(text):
    with pytest.raises(ValueError):
        parse_time_limit(text)


def test_time_limit_round_trip():
    assert format_time_limit(95400) == "1-02:30:00"
    assert format_time_limit(61) == "0-00:02:00"  # SLURM limits are whole minutes: round up
    assert parse_time_limit(format_time_limit(7200)) == 7200


def test_shipped_configs_validate():
    from conftest import ROOT

    for name in ("example.yaml", "local.yaml"):
        r = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(ROOT / "configs" / name)],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stdout + r.stderr
    example = load_config(ROOT / "configs" / "example.yaml", {"SLURMFLEET_SHARED": "/shared"})
    shapes = {(m.nodes, m.tensor_parallel_size, m.pipeline_parallel_size) for m in example.models}
    assert {(1, 1, 1), (1, 8, 1), (2, 8, 2)} <= shapes
    assert any(m.replicas >= 3 and m.tensor_parallel_size == 1 for m in example.models)


def test_validate_cli_prints_positions_and_exits_2(tmp_path):
    from conftest import ROOT

    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE + "    replicas: -1\n    tensor_parallel_size: 0\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(bad)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(f"{bad}:7:15: models[0].replicas: ")
    assert lines[1].startswith(f"{bad}:8:27: models[0].tensor_parallel_size: ")


@pytest.mark.parametrize("snippet", ["    time_limit: 2\n    drain: {signal_lead_s: 59}\n", "    time_limit: 8\n",
                                     "    time_limit: UNLIMITED\n    drain: {signal_lead_s: 65535}\n",
                                     "    time_limit: 9\n    drain: {stagger_s: 60}\n"])
def test_a_time_limit_warning_after_half_the_shortest_slot_limit_passes(snippet):
    load_config_text(BASE + snippet, "fleet.yaml", {})


def test_job_hash_ignores_replicas_but_not_args():
    a = load_config_text(BASE, "f", {}).models[0]
    b = load_config_text(BASE + "    replicas: 5\n    aliases: [x]\n", "f", {}).models[0]
    c = load_config_text(BASE + "    env: {A: '1'}\n", "f", {}).models[0]
    assert a.job_hash() == b.job_hash() != c.job_hash()


def test_the_engine_hash_follows_what_a_replica_generates_with_not_where_or_how_fast():
    """Generations move between replicas of the same engine hash only (orchestrator.gateway.resumeplan)."""
    vllm = BASE.replace("engine: simulator", "engine: vllm\n    model_path: /models/a")
    base = load_config_text(vllm, "f", {}).models[0].engine_hash()
    for same in ("    partition: other\n    time_limit: 60\n", "    tensor_parallel_size: 2\n    gpus_per_node: 2\n",
                 "    vllm_args: {max-num-seqs: 8, gpu-memory-utilization: 0.8, allowed-origins: '[\"x\"]'}\n",
                 "    replicas: 3\n", "    env: {NCCL_DEBUG: INFO}\n"):
        assert load_config_text(vllm + same, "f", {}).models[0].engine_hash() == base, same
    for other in ("    vllm_args: {tokenizer: /models/t}\n", "    vllm_args: {max-model-len: 2048}\n",
                  "    vllm_args: {stream-interval: 4}\n"):
        assert load_config_text(vllm + other, "f", {}).models[0].engine_hash() != base, other
    image = vllm.replace("container: {enabled: false}", "container: {image: /img/a.sif, binds: ['/w/a:/models/a']}")
    with_image = load_config_text(image, "f", {}).models[0].engine_hash()
    assert load_config_text(image.replace("a.sif", "b.sif"), "f", {}).models[0].engine_hash() == with_image
    assert load_config_text(image.replace("/w/a:", "/w/b:"), "f", {}).models[0].engine_hash() != with_image
    assert load_config_text(vllm.replace("/models/a", "/models/b"), "f", {}).models[0].engine_hash() != base
    sim = load_config_text(BASE, "f", {}).models[0].engine_hash()
    assert load_config_text(BASE + "    simulator: {tokens_per_s: 5}\n", "f", {}).models[0].engine_hash() == sim


def test_kv_aware_refuses_only_the_vllm_args_its_tokenizer_cannot_follow():
    """A ``routing: kv_aware`` model may not start its engine with tokenizing flags the gateway does not follow
    (its block hashes would never match); values that change nothing, the flags it follows (``tokenizer``,
    ``chat-template``) and other routings are accepted."""
    kv = BASE + "    routing: kv_aware\n    vllm_args: {%s}\n"
    for ok in ("tokenizer-mode: auto, chat-template-content-format: auto", "tokenizer-mode: hf",
               "tokenizer: /models/tok, chat-template: /models/t.jinja", "exclude-tools-when-tool-choice-none: false"):
        assert load_config_text(kv % ok, "f", {}).models[0].vllm_args
    # vLLM drops a request's tools when its tool_choice is none: the gateway renders them (every such prompt a miss)
    assert "exclude-tools-when-tool-choice-none" in problems(kv % "exclude-tools-when-tool-choice-none: true")[0]
    got = problems(kv % "default-chat-template-kwargs: '{\"enable_thinking\": false}'")
    assert got == ["fleet.yaml:8:47: models[0].vllm_args.default-chat-template-kwargs: vllm_args default-chat-template-kwargs change how the engine tokenizes "
                   "prompts, which routing kv_aware cannot follow (its cache lookups would never match): remove "
                   "them, or route otherwise"], got
    assert load_config_text(BASE + "    vllm_args: {tokenizer-mode: mistral}\n", "f", {}).models[0].vllm_args


@pytest.mark.parametrize("value, seconds", [("1:30:00", 5400), ("30:00", 1800), ("8:00:00", 8 * 3600),
                                            ("04:00:00", 4 * 3600), ("90", 5400), ("010", 600), ("1-0", 86400)])
def test_an_unquoted_time_limit_means_what_slurm_reads(value, seconds):
    """YAML 1.1 read an unquoted 1:30:00 as the base-60 number 5400, which a time limit takes as minutes
    (90 hours), and 010 as octal 8: numbers here are YAML 1.2's, so SLURM's forms mean what SLURM says."""
    cfg = load_config_text(BASE + f"    time_limit: {value}\n", "fleet.yaml", {})
    assert cfg.models[0].time_limit == seconds


def test_yaml_dates_infinities_and_odd_files_are_positioned_problems(tmp_path):
    cfg = load_config_text(BASE + "    env: {RELEASE: 2024-05-01}\n    replicas: 010\n", "fleet.yaml", {})
    assert dict(cfg.models[0].env) == {"RELEASE": "2024-05-01"} and cfg.models[0].replicas == 10   # (not a date)
    assert any(p.startswith("fleet.yaml:7:17: models[0].time_limit") for p in
               problems(BASE + "    time_limit: 2024-02-30\n"))   # (was a traceback: day out of range)
    assert any(p.startswith("fleet.yaml:7:") and "drain" in p for p in
               problems(BASE + "    drain: {stagger_s: .inf}\n"))   # (validated, then no job could be rendered)
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path))   # a directory: a problem, not IsADirectoryError
    assert "not a regular file" in str(info.value.problems[0])


def test_a_served_name_used_twice_is_reported_where_it_is_used_again():
    text = BASE + "  - name: b\n    engine: simulator\n    aliases: [x, llama-8b]\n    container: {enabled: false}\n"
    assert problems(text) == ["fleet.yaml:9:18: models[1].aliases[1]: served name, alias or LoRA adapter 'llama-8b' of model 'b' "
                              "is already used by model 'llama-8b'"]


def test_a_merge_key_says_what_to_use_instead():
    text = BASE + "    <<: {replicas: 2}\n"
    assert problems(text) == ["fleet.yaml:7:5: models[0]: merge keys (<<) are not supported: `defaults:` holds what "
                              "every model shares"]


def test_vllm_args_values_that_are_negative_numbers_pass():
    """argparse takes a negative number (and a lone ``-``) after an option as its value, never as an option."""
    text = BASE + '    vllm_args: {va: "-1", vb: "-0.5", vc: -2, vd: -0.25, ve: ["-3", 4, "x-y"], vf: "-", vg: true}\n'
    assert load_config_text(text, "f", {}).models[0].vllm_args["ve"] == ["-3", 4, "x-y"]
    assert [p.split(": ")[1] for p in problems(text.replace('"-0.5"', '"-1e5"'))] == ["models[0].vllm_args.vb"]


def test_a_value_at_the_limit_in_bytes_passes():
    assert load_config_text(BASE + "    env: {A: " + "é" * 32_768 + "}\n", "f", {}).models[0].env["A"]
    assert problems(BASE + "    env: {A: x" + "é" * 32_768 + "}\n") == [
        "fleet.yaml:7:14: models[0].env.A: is 65537 bytes long in UTF-8; at most 65536"]


def test_env_names_like_bashs_own_pass():
    """Only bash's own variables are refused: names that merely resemble them reach the engine as set."""
    names = ["UID_MAP", "MY_UID", "BASH", "BASHX", "PATH", "HOSTNAME", "OPTIND", "__", "RANDOM_SEED"]
    text = BASE + "    env: {" + ", ".join(f"{n}: v" for n in names) + "}\n"
    assert list(load_config_text(text, "f", {}).models[0].env) == names


def test_a_plain_variable_alone_that_expands_to_true_is_the_flag():
    """``enable-prefix-caching: ${PREFIX}`` with PREFIX=true is the bare flag, as ``true`` written there is (the
    text "true" rendered `--enable-prefix-caching true`, which vLLM refuses); a quoted one, or one inside more
    text, stays text, and a typed field reads either."""
    text = BASE.replace("engine: simulator", "model_path: /m").replace(
        "container: {enabled: false}", "container:\n      enabled: ${BOX}\n    vllm_args:\n"
        "      enable-prefix-caching: ${ON}\n      enforce-eager: ${OFF}\n      quoted: \"${ON}\"\n      more: x${ON}\n"
        "      max-model-len: ${LEN}") + "cluster:\n  sbatch_options:\n    exclusive: ${EX:-true}\n"
    cfg = load_config_text(text, "f.yaml", {"ON": "true", "OFF": "False", "LEN": "512", "BOX": "no"})
    m = cfg.models[0]
    assert m.vllm_args == {"enable-prefix-caching": True, "enforce-eager": False, "quoted": "true", "more": "xtrue",
                           "max-model-len": "512"}
    assert cfg.cluster.sbatch_options == {"exclusive": True} and m.container.enabled is False
    assert problems(BASE + "    account: ${A}\n", {"A": "true"}) == [
        "fleet.yaml:7:14: models[0].account: must be text, and YAML read this value as a boolean (true): put it in quotes"]


def test_a_check_across_fields_is_told_at_the_field_the_file_sets():
    """A model-wide check names the field it is about, at its line (where `defaults:` sets it, for a value
    inherited from there), not the first line of the model's mapping."""
    inherited = ("fleet: prod\nstate_dir: /s\ndefaults:\n  gpus_per_node: 4\nmodels:\n  - name: big\n    model_path: /m\n"
                 "    container: {enabled: false}\n    nodes: 2\n")
    assert problems(inherited) == ["fleet.yaml:4:18: models[0].gpus_per_node: tensor_parallel_size 1 x "
                                   "pipeline_parallel_size 1 = 1 GPUs must equal nodes x gpus_per_node = 2 x 4 = 8"]
    twice = BASE + "  - name: other\n    engine: simulator\n    container: {enabled: false}\n    aliases: [x, llama-8b]\n"
    assert problems(twice) == ["fleet.yaml:10:18: models[1].aliases[1]: served name, alias or LoRA adapter 'llama-8b' of model "
                               "'other' is already used by model 'llama-8b'"]
    bounds = BASE + "    autoscale:\n      max_replicas: 2\n      min_replicas: 3\n"
    assert problems(bounds) == ["fleet.yaml:9:21: models[0].autoscale.min_replicas: min_replicas (3) is greater "
                                "than max_replicas (2)"]


@pytest.mark.parametrize("top,clash", [
    ("gateway: {port: 8081}\n", "fleet.yaml:1:17: gateway.port: daemon.admin_port 8081 is gateway.port too"),
    ("gateway: {port: 9000, host: 0.0.0.0}\ndaemon: {admin_port: 9000}\n",
     "fleet.yaml:2:22: daemon.admin_port: daemon.admin_port 9000 is gateway.port too (hosts '127.0.0.1' and '0.0.0.0')"),
    ("gateway: {port: 9000, host: 10.0.0.1}\ndaemon: {admin_port: 9000, admin_host: 10.0.0.2}\n", None),
    ("gateway: {port: 0}\ndaemon: {admin_port: 8082}\n", None),   # (0: any free port)
    # the admin API on any free port: no CLI command, and no scrape, could find it
    ("daemon: {admin_port: 0}\n", "fleet.yaml:1:22: daemon.admin_port: Input should be greater than or equal to 1"),
    # an IPv6 listener takes its port in IPv6 only (asyncio binds it IPV6_V6ONLY): these both listen
    ("gateway: {port: 9000, host: '::'}\ndaemon: {admin_port: 9000}\n", None),
    ("gateway: {port: 9000, host: '::'}\ndaemon: {admin_port: 9000, admin_host: 0.0.0.0}\n", None),
    ("gateway: {port: 9000, host: '::'}\ndaemon: {admin_port: 9000, admin_host: '::1'}\n",
     "fleet.yaml:2:22: daemon.admin_port: daemon.admin_port 9000 is gateway.port too"),
])
def test_the_admin_api_and_the_gateway_on_one_port_is_a_positioned_problem(top, clash):
    """(it validated, and the daemon's second listener failed at start)"""
    if clash is None:
        assert load_config_text(top + BASE, "fleet.yaml", {}).models   # (no ConfigError)
        return
    got = problems(top + BASE)
    assert len(got) == 1 and got[0].startswith(clash), got


def test_data_parallel_counts_in_a_replicas_gpus():
    """vLLM's world is tensor x pipeline x prefill-context x data parallel: a replica of two data-parallel engines
    of TP 2 on 4 GPUs is right (it was refused: TP x PP = 2 against 4), and one on 2 GPUs is not."""
    text = TWO_NODES.replace("nodes: 2", "nodes: 1").replace("gpus_per_node: 8", "gpus_per_node: 4").replace(
        "tensor_parallel_size: 8", "tensor_parallel_size: 2")
    cfg = load_config_text(text + "    vllm_args: {data-parallel-size: 2}\n", "fleet.yaml", {})
    assert cfg.models[0].gpus_per_node == 4
    got = problems(text.replace("gpus_per_node: 4", "gpus_per_node: 2") + "    vllm_args: {data-parallel-size: 2}\n")
    assert got == ["fleet.yaml:9:27: models[0].tensor_parallel_size: tensor_parallel_size 2 x pipeline_parallel_size 1 x "
                   "vllm_args data-parallel-size 2 = 4 GPUs must equal nodes x gpus_per_node = 1 x 2 = 2"]


def test_a_simulator_model_has_no_container_unless_it_asks_for_one():
    """A fleet's defaults give its vLLM models their image; a simulator model (the daemon's own Python, in no
    image) took it too and could never start, and one with no container at all was refused for want of an
    image: it has none unless it sets one, which is refused at its line."""
    text = ("fleet: f\nstate_dir: /s\ndefaults:\n  container: {image: /i.sif, binds: ['/m:/m']}\nmodels:\n"
            "  - {name: v, model_path: /m/x}\n  - {name: s, engine: simulator}\n")
    v, s = load_config_text(text, "fleet.yaml", {}).models
    assert v.container.enabled and str(v.container.image) == "/i.sif" and not s.container.enabled
    assert not load_config_text("fleet: f\nstate_dir: /s\nmodels:\n  - {name: s, engine: simulator}\n",
                                "fleet.yaml", {}).models[0].container.enabled


def test_what_operators_write_by_mistake_is_said_in_their_words():
    """From a review of ~130 broken files: an empty section is its defaults (it was "Input should be a valid
    dictionary or instance of ProbeConfig"); a bare memory number is refused (sbatch reads it as MB: `memory: 64`
    ran out of memory); a host with a port or a URL's scheme is refused (the CLI later blamed --admin-url); a tab
    says what YAML wants; a misspelt required field is said once, with the field it meant."""
    cfg = load_config_text(BASE + "    probe:\n    gateway:\ngateway:\n", "f.yaml", {})
    assert cfg.models[0].probe.interval_s == ProbeConfig().interval_s and cfg.gateway.port == 8000
    assert problems(BASE + "    memory: 64\n") == [
        "fleet.yaml:7:13: models[0].memory: memory 64 has no unit: write 64G, or 64M (SLURM reads a bare number as MB)"]
    assert load_config_text(BASE + "    memory: 64G\n", "f.yaml", {}).models[0].memory == "64G"
    got = problems(BASE + "gateway: {host: '0.0.0.0:8000'}\ndaemon: {admin_host: 'http://h'}\n")
    assert got == ["fleet.yaml:7:17: gateway.host: '0.0.0.0:8000' is no address: a host name or an IPv4 or IPv6 "
                   "address, the port in its own field",
                   "fleet.yaml:8:22: daemon.admin_host: 'http://h' is not allowed: an address or a host name (no "
                   "scheme, no port)"], got
    assert load_config_text(BASE + "gateway: {host: '::'}\n", "f.yaml", {}).gateway.host == "::"
    assert "(a tab: YAML indents with spaces only)" in problems(BASE.replace("    engine", "\tengine"))[0]
    got = problems(BASE.replace("fleet: prod", "flet: prod").replace("engine:", "gpu_per_node: 1\n    engine:"))
    assert got == ["fleet.yaml:1:1: flet: unknown field (did you mean 'fleet'?)",
                   "fleet.yaml:5:5: models[0].gpu_per_node: unknown field (did you mean 'gpus_per_node'?)"], got

