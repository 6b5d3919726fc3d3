"""The ``slurmfleet`` command's failures: a clear line and an exit status, never a traceback.  The CLI runs in
this process (``orchestrator.cli.main``); the daemon's admin API and the gateway are small HTTP servers in a
thread standing in for them at the process boundary (no daemon, no cluster)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from conftest import free_port
from orchestrator import cli
from orchestrator.devtools import demo
from orchestrator.devtools.localcluster import ClusterError

DIGEST = "sha256:" + "ab" * 32


class FakeServer:
    """An HTTP server answering every request with ``answer`` (status, content type, body) and recording
    each one as (method, path, headers, body)."""

    def __init__(self):
        self.answer: tuple[int, str, bytes] = (200, "application/json", b"{}")
        self.requests: list[tuple[str, str, dict, bytes]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.requests.append((self.command, self.path, dict(self.headers), body))
                status, ctype, data = owner.answer
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _any

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_admin_key_env(monkeypatch):
    monkeypatch.delenv("SLURMFLEET_ADMIN_KEY", raising=False)
    monkeypatch.delenv("SLURMFLEET_LOG_LEVEL", raising=False)


def fleet(tmp_path, admin_keys: list[str] | None = None, models: list[dict] | None = None) -> str:
    cfg = {"fleet": "cli-test", "state_dir": str(tmp_path / "state"),
           "daemon": {"admin_port": 1, "admin_api_keys": admin_keys or []},
           "models": models or []}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def sim(name: str, **kw) -> dict:
    return {"name": name, "engine": "simulator", "gpus_per_node": 1, "cpus_per_task": 1,
            "container": {"enabled": False}, **kw}


def run(capsys, *argv: str) -> tuple[int | str, str, str]:
    """(exit status, stdout, stderr) of ``slurmfleet ARGV``; an exception that escapes main is the status."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    except (Exception, KeyboardInterrupt) as exc:   # (a KeyboardInterrupt would end the whole pytest run)
        code = f"escaped: {type(exc).__name__}: {exc}"
    out, err = capsys.readouterr()
    return code, out, err


# drain: job ids, and answers that are not JSON

def test_drain_refuses_what_is_not_a_slurm_job_id(tmp_path, capsys, server):
    code, _, err = run(capsys, "drain", "1 2", "-c", fleet(tmp_path), "--admin-url", server.url)
    assert code == 2 and "'1 2' is not a SLURM job id" in err, (code, err)
    assert server.requests == []
    server.answer = (200, "application/json", b'{"ok": true}')
    assert run(capsys, "drain", "123_4", "-c", fleet(tmp_path), "--admin-url", server.url)[0] == 0
    assert server.requests[0][:2] == ("POST", "/admin/drain/123_4")


@pytest.mark.parametrize("argv", [["status"], ["drain", "42"], ["reload"]])
@pytest.mark.parametrize("answer", [(404, "text/plain", b"404 page not found\n"),
                                    (502, "text/html", b"<html><body>Bad Gateway</body></html>"),
                                    (200, "application/json", b"[1, 2]")])
def test_an_answer_that_is_not_a_json_object_is_reported(tmp_path, capsys, server, argv, answer):
    server.answer = answer
    code, out, err = run(capsys, *argv, "-c", fleet(tmp_path), "--admin-url", server.url)
    assert code == 1, (code, err)
    assert f"the admin API at {server.url} answered HTTP {answer[0]} with no JSON object" in err
    assert answer[2][:10].decode() in err and "Traceback" not in err and out == ""


def test_reload_exits_2_for_a_file_refused_1_for_a_daemon_failing_or_refusing_the_call(tmp_path, capsys, server):
    """A refused reload exited 2 whatever refused it: a daemon that failed applying a good file, or an admin API
    that refused the call, read as invalid input (the README: 1 for failed or refused)."""
    path = fleet(tmp_path)
    for status, body, want, said in [
            (422, {"ok": False, "invalid": True, "errors": ["f.yaml:3:4: replicas: bad"]}, 2, "f.yaml:3:4: replicas"),
            (422, {"ok": False, "invalid": False, "errors": ["f.yaml: OSError: disk"]}, 1, "f.yaml: OSError: disk"),
            (503, {"error": {"message": "The daemon is stopping."}}, 1, "slurmfleet reload: The daemon is stopping."),
            (200, {"ok": True, "changes": ["m: 1 -> 2 replicas"]}, 0, "")]:
        server.answer = (status, "application/json", json.dumps(body).encode())
        code, out, err = run(capsys, "reload", "-c", path, "--admin-url", server.url)
        assert code == want and said in err, (body, code, err)
        assert ("m: 1 -> 2 replicas" in out) == (want == 0), out


# a daemon that takes the connection and says nothing

def test_a_daemon_that_does_not_answer(tmp_path, capsys, monkeypatch):
    urlopen = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout, **kw: urlopen(req, timeout=0.3, **kw))
    with socket.socket() as silent:   # listens (the kernel completes the handshake), never accepts
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        code, _, err = run(capsys, "status", "-c", fleet(tmp_path), "--admin-url", url)
    assert code == 1 and err.strip() == f"cannot reach the daemon at {url}: no answer within 10s", (code, err)


def test_a_daemon_that_is_not_there(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = run(capsys, "status", "-c", fleet(tmp_path), "--admin-url", url)
    assert code == 1 and err.startswith(f"cannot reach the daemon at {url}: ") and "refused" in err, err
    # from the file (no --admin-url): which file's address, and how its daemon starts; -c before the command too
    code, _, err = run(capsys, "-c", (path := fleet(tmp_path)), "status")
    assert code == 1 and f"daemon.admin_host/admin_port of {path}: is its daemon running, `slurmfleet serve -c " \
        f"{path}`?" in err, err


def test_a_gateway_that_is_not_there_or_silent_is_said_plainly(tmp_path, capsys, monkeypatch):
    """`slurmfleet batch` printed aiohttp's "Cannot connect to host ... ssl:default" on plain HTTP, and waited for
    aiohttp's 5 minutes on a gateway that took the connection and said nothing."""
    from orchestrator import batchcli
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = run(capsys, "batch", "list", "-c", fleet(tmp_path), "--url", url, "--api-key", "k")
    assert code == 1 and f"cannot reach the gateway at {url} (" in err and "ssl" not in err, err
    assert "is the daemon running (`slurmfleet serve`)" in err, err
    monkeypatch.setattr(batchcli, "READ_TIMEOUT_S", 0.3)
    with socket.socket() as silent:   # (listens, never answers)
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        code, _, err = run(capsys, "batch", "list", "-c", fleet(tmp_path), "--url", url, "--api-key", "k")
    assert code == 1 and f"the gateway at {url} did not answer in 0s" in err, err


# Ctrl-C in the watch modes

def test_ctrl_c_in_status_watch_exits_130_quietly(tmp_path, capsys, server, monkeypatch):
    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", interrupted)
    server.answer = (200, "application/json", b'{"models": []}')
    code, out, err = run(capsys, "status", "--watch", "2", "--json", "-c", fleet(tmp_path), "--admin-url", server.url)
    assert code == 130 and json.loads(out) == {"models": []} and err == "", (code, err)


def test_admin_commands_reach_the_daemon_of_a_file_it_refused(tmp_path, capsys, server):
    """After an edit the daemon refused (it runs on its last good file), status, drain and scale refused to run:
    the file's problems, exit 2, even with --admin-url. They now reach the daemon with the file's fleet,
    state_dir and daemon settings, and say the file does not validate. Found by a soak."""
    path = fleet(tmp_path, ["adm-secret"], [sim("m", replicas="x")])
    server.answer = (200, "application/json", b'{"ok": true}')
    for argv in (["status", "--json"], ["drain", "12"], ["scale", "m", "2"]):
        code, _, err = run(capsys, *argv, "-c", path, "--admin-url", server.url)
        assert code == 0 and f"warning: {path} does not validate (1 problem(s)" in err, (argv, code, err)
        assert server.requests[-1][2]["Authorization"] == "Bearer adm-secret"   # (the file's admin key)
    assert [r[1] for r in server.requests] == ["/admin/status", "/admin/drain/12", "/admin/scale"]
    cfg = pathlib.Path(path)
    cfg.write_text(cfg.read_text().replace("admin_port: 1", "admin_port: many"))
    code, _, err = run(capsys, "status", "-c", path, "--admin-url", server.url)   # what reaches it is wrong too
    assert code == 2 and "daemon.admin_port" in err and "models[0].replicas" in err, (code, err)
    assert len(server.requests) == 3


@pytest.mark.parametrize("argv", [["status", "b1", "--watch"], ["status", "b1", "--watch", "--json"]])
def test_ctrl_c_in_batch_watch_exits_130_quietly(tmp_path, capsys, server, monkeypatch, argv):
    async def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.batchcli, "watch", interrupted)
    code, _, err = run(capsys, "batch", "-c", fleet(tmp_path), "--url", server.url, *argv)
    assert code == 130 and err == "", (code, err)


# which admin key is sent: the daemon's choice (orchestrator.fleet.admin.ensure_admin_key)

def sent_key(server) -> str:
    return server.requests[-1][2]["Authorization"].removeprefix("Bearer ")


def test_a_configured_admin_key_wins_over_the_generated_file(tmp_path, capsys, server, monkeypatch):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "admin.key").write_text("generated\n")
    cfg = fleet(tmp_path, admin_keys=[DIGEST, "configured"])
    assert run(capsys, "status", "--json", "-c", cfg, "--admin-url", server.url)[0] == 0
    assert sent_key(server) == "configured"   # the first key that is not a digest; the daemon ignores the file
    monkeypatch.setenv("SLURMFLEET_ADMIN_KEY", "from-env")
    assert run(capsys, "status", "--json", "-c", cfg, "--admin-url", server.url)[0] == 0
    assert sent_key(server) == "from-env"
    monkeypatch.delenv("SLURMFLEET_ADMIN_KEY")
    assert run(capsys, "status", "--json", "-c", fleet(tmp_path), "--admin-url", server.url)[0] == 0
    assert sent_key(server) == "generated"    # none configured: the daemon generated this one


def test_only_digests_configured_asks_for_the_key(tmp_path, capsys, server):
    cfg = fleet(tmp_path, admin_keys=[DIGEST])
    code, _, err = run(capsys, "status", "-c", cfg, "--admin-url", server.url)
    assert code == 2 and "only sha256: digests" in err and "SLURMFLEET_ADMIN_KEY" in err, (code, err)
    assert server.requests == []   # a digest is never sent as the key


# unreadable state directories

def test_an_unreadable_admin_key_is_named(tmp_path, capsys, server, monkeypatch):
    keyfile = tmp_path / "state" / "admin.key"
    keyfile.parent.mkdir()
    keyfile.write_text("generated\n")
    read_text = pathlib.Path.read_text

    def denied(self, *a, **kw):
        if self == keyfile:   # (tests may run as root, whom no file mode stops)
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    code, _, err = run(capsys, "status", "-c", fleet(tmp_path), "--admin-url", server.url)
    assert code == 1 and err.strip() == f"cannot read the admin key {keyfile}: Permission denied", (code, err)


def test_an_unreadable_usage_ledger_is_named(tmp_path, capsys, monkeypatch):
    state = tmp_path / "state"
    is_file = pathlib.Path.is_file

    def denied(self):
        if state in self.parents:   # an unreadable state dir: stat() of what is in it fails with EACCES
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", denied)
    code, _, err = run(capsys, "usage", "-c", fleet(tmp_path))
    assert code == 1 and err.strip() == f"cannot read {state / 'usage.sqlite3'}: Permission denied", (code, err)


def test_a_usage_span_that_ends_before_it_starts_is_refused(tmp_path, capsys):
    """It printed an empty table (its span backwards) and exit 0. Found by a soak."""
    for since, until in (("2099-01-01", "now"), ("1h", "2d")):
        code, out, err = run(capsys, "usage", "-c", fleet(tmp_path), "--since", since, "--until", until)
        assert code == 2 and not out and "--since (" in err and ") is after --until (" in err, (code, out, err)


# scale: an alias means its model

def test_scale_sends_the_model_an_alias_names(tmp_path, capsys, server):
    server.answer = (200, "application/json", b'{"ok": true}')
    cfg = fleet(tmp_path, admin_keys=["k"], models=[sim("sim-small", aliases=["sim"])])
    assert run(capsys, "scale", "sim", "2", "-c", cfg, "--admin-url", server.url)[0] == 0
    assert json.loads(server.requests[-1][3]) == {"model": "sim-small", "replicas": 2}
    assert run(capsys, "scale", "other", "auto", "-c", cfg, "--admin-url", server.url)[0] == 0
    assert json.loads(server.requests[-1][3]) == {"model": "other", "replicas": "auto"}   # the daemon says 404


# validate: an autoscaled model's bounds

def test_validate_shows_an_autoscaled_models_bounds(tmp_path, capsys):
    cfg = fleet(tmp_path, models=[sim("fixed", replicas=2), sim("elastic", autoscale={"min_replicas": 0,
                                                                                     "max_replicas": 3})])
    code, out, _ = run(capsys, "validate", cfg)
    assert code == 0
    assert "  fixed: 2 x (" in out and "  elastic: autoscaled 0-3 x (" in out, out


def test_validate_warns_of_an_autoscale_target_above_what_a_replica_takes(tmp_path, capsys):
    """Valid, but working against each other: 8 per replica as the target with the gateway letting a replica
    take 5 (kv_aware's advice, --max-num-seqs + 1): replicas fill before the load rule asks for more."""
    cfg = fleet(tmp_path, models=[sim("elastic", max_inflight_per_replica=5,
                                      autoscale={"min_replicas": 0, "max_replicas": 3}),
                                  sim("fine", max_inflight_per_replica=8, autoscale={"max_replicas": 2})])
    code, out, err = run(capsys, "validate", cfg)
    assert code == 0 and "warning: model elastic: autoscale.target_inflight_per_replica 8 is above the 5" in err, err
    assert "set it at or below 5" in err and "model fine" not in err


def test_validate_warns_of_an_autoscale_target_above_what_the_engines_run(tmp_path, capsys):
    """A target per replica above the engine's slots plus engine_waiting_high: the engines queue past the
    high before the load rule asks for more, and engine pressure sizes the model.  Slots count the engine's
    data-parallel ranks; a target the slots and the high hold is no warning."""
    vllm = {"name": "dp", "model_path": str(tmp_path), "gpus_per_node": 2, "cpus_per_task": 1,
            "container": {"enabled": False},
            "vllm_args": {"max-num-seqs": 4, "data-parallel-size": 2},
            "autoscale": {"max_replicas": 2, "target_inflight_per_replica": 12}}
    cfg = fleet(tmp_path, models=[sim("narrow", simulator={"max_num_seqs": 4},
                                      autoscale={"max_replicas": 3, "target_inflight_per_replica": 10}),
                                  sim("edge", simulator={"max_num_seqs": 4}, autoscale={"max_replicas": 3}),
                                  vllm])
    code, out, err = run(capsys, "validate", cfg)
    assert code == 0, (out, err)
    assert ("warning: model narrow: autoscale.target_inflight_per_replica 10 is above the 4 sequences a "
            "replica's engine runs at once plus autoscale.engine_waiting_high (4)") in err, err
    assert "set it at or below 8, or raise the engines' max-num-seqs" in err
    assert "model edge" not in err and "model dp" not in err, err   # 8 <= 4 + 4; 12 <= 4 x 2 + 4


def test_validate_takes_the_config_as_the_other_commands_do(tmp_path, capsys, monkeypatch):
    """`validate -c FILE` and $SLURMFLEET_CONFIG name the file as they do for `render` or `status`; a file
    named positionally still wins."""
    good = fleet(tmp_path, models=[sim("only", replicas=1)])
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet: x\nmodels: 3\n")
    code, out, _ = run(capsys, "validate", "-c", good)
    assert code == 0 and out.startswith(f"{good}: fleet 'cli-test', 1 model(s)"), out
    monkeypatch.setenv("SLURMFLEET_CONFIG", str(bad))
    code, out, err = run(capsys, "validate")
    assert code == 2 and f"{bad}:2:" in out, (out, err)
    assert run(capsys, "validate", good)[0] == 0


# batch: --json keeps stdout JSON; options after the subcommand

def test_batch_status_watch_json_prints_only_json(tmp_path, capsys, server):
    batch = {"id": "b1", "status": "completed", "endpoint": "/v1/chat/completions",
             "request_counts": {"total": 2, "completed": 2, "failed": 0}}
    server.answer = (200, "application/json", json.dumps(batch).encode())
    code, out, err = run(capsys, "batch", "-c", fleet(tmp_path), "--url", server.url, "status", "b1", "--watch",
                         "--json")
    assert code == 0, err
    assert json.loads(out) == batch   # the progress bar went to stderr
    assert "b1" in err


def test_batch_options_after_the_subcommand(tmp_path, capsys, server):
    server.answer = (200, "application/json", b'{"data": [], "has_more": false}')
    cfg = fleet(tmp_path)
    code, out, err = run(capsys, "batch", "list", "-c", cfg, "--url", server.url, "--api-key", "sk-1", "--json")
    assert code == 0 and json.loads(out) == [], (code, err)
    assert server.requests[-1][1].startswith("/v1/batches") and sent_key(server) == "sk-1"
    # given before the subcommand and not after it, they stay
    code, out, err = run(capsys, "batch", "-c", cfg, "--url", server.url, "--api-key", "sk-2", "list", "--json")
    assert code == 0 and sent_key(server) == "sk-2", (code, err)
    # after it, they win
    code, _, err = run(capsys, "batch", "--api-key", "sk-3", "-c", cfg, "--url", "http://127.0.0.1:1", "list",
                       "--url", server.url, "--api-key", "sk-4")
    assert code == 0 and sent_key(server) == "sk-4", (code, err)


def test_batch_takes_its_key_from_a_file_kept_off_the_command_line(tmp_path, capsys, server, monkeypatch):
    """--api-key shows in `ps` to every user of a shared login node: --api-key-file (its first line) does not."""
    monkeypatch.delenv("SLURMFLEET_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server.answer = (200, "application/json", b'{"data": [], "has_more": false}')
    cfg, key = fleet(tmp_path), tmp_path / "key"
    key.write_text("sk-from-file\n")
    code, _, err = run(capsys, "batch", "-c", cfg, "--url", server.url, "list", "--api-key-file", str(key))
    assert code == 0 and sent_key(server) == "sk-from-file", (code, err)
    code, _, err = run(capsys, "batch", "-c", cfg, "--url", server.url, "--api-key-file", str(tmp_path / "no"), "list")
    assert code == 2 and "--api-key-file" in err and "cannot read" in err, (code, err)


# demo: a bad config or a cluster that does not start

class FakeCluster:
    started: list[bool] = []

    def __init__(self, fail: bool, root):
        self.fail, self.conf = fail, root / "etc" / "slurm.conf"

    def up(self) -> float:
        FakeCluster.started.append(True)
        if self.fail:
            raise ClusterError("slurmctld did not answer within 30s")
        return 0.1

    def describe(self) -> str:
        return "fake"


@pytest.fixture
def fake_cluster(monkeypatch, tmp_path):
    FakeCluster.started = []
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))   # (run_demo sets it only where unset)

    def use(fail: bool):
        monkeypatch.setattr(demo, "LocalCluster", lambda: FakeCluster(fail, tmp_path))
        return FakeCluster.started
    return use


def test_demo_reports_a_cluster_that_does_not_start(tmp_path, capsys, fake_cluster):
    started = fake_cluster(fail=True)
    code, _, err = run(capsys, "demo", "-c", fleet(tmp_path, models=[sim("sim-small")]))
    assert started and code == 1 and err.strip() == "demo: slurmctld did not answer within 30s", (code, err)


def test_demo_checks_the_config_before_starting_the_cluster(tmp_path, capsys, fake_cluster):
    started = fake_cluster(fail=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet: demo\nstate_dir: relative\n")
    code, _, err = run(capsys, "demo", "-c", str(bad))
    assert code == 2 and f"{bad}:2:" in err and "state_dir" in err, (code, err)
    assert started == []


# --log-level

@pytest.mark.parametrize("from_env", [False, True])
def test_an_unknown_log_level(tmp_path, capsys, monkeypatch, from_env):
    if from_env:
        monkeypatch.setenv("SLURMFLEET_LOG_LEVEL", "bogus")
    argv = ["validate", fleet(tmp_path)] if from_env else ["--log-level", "bogus", "validate", fleet(tmp_path)]
    code, out, err = run(capsys, *argv)
    assert code == 2 and "unknown level 'bogus'" in err and out == "", (code, err)
    assert run(capsys, "--log-level", "warning", "validate", fleet(tmp_path))[0] == 0


def test_main_called_in_a_process_that_goes_on_leaves_its_sigpipe_as_it_was(tmp_path):
    """`slurmfleet validate | head` ends quietly (SIGPIPE's default for the command's own process), but main()
    put it back: a test that called it left the pytest worker to die of SIGPIPE at its next write to a closed
    socket (a gateway test's client after a 408: the worker crashed, 'not properly terminated')."""
    import signal

    from orchestrator import cli

    before = signal.getsignal(signal.SIGPIPE)
    path = tmp_path / "f.yaml"
    path.write_text("fleet: f\nstate_dir: /tmp/x\nmodels: []\n")
    assert cli.main(["validate", str(path)]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN


@pytest.mark.parametrize("argv, says", [
    (["status", "--watch", "-1"], "'-1' is not a number of seconds above 0"),
    (["status", "--watch", "nan"], "'nan' is not a number of seconds above 0"),
    (["status", "--watch", "inf"], "'inf' is not a number of seconds above 0 and at most 86400"),
    (["status", "--watch", "1e10"], "'1e10' is not a number of seconds above 0 and at most 86400"),
    (["scale", "m", "1000001"], "a count must be from 0 to 1000"),
])
def test_bad_counts_and_intervals_are_argparse_errors(tmp_path, capsys, argv, says):
    """A negative, NaN or infinite --watch failed in time.sleep after the first print; a count above the file's limit
    went to the daemon, which planned a million slots in its tick."""
    code, _, err = run(capsys, *argv, "-c", fleet(tmp_path))
    assert code == 2 and says in err, (code, err)


def test_an_admin_url_with_a_trailing_slash_reaches_the_api(tmp_path, capsys, server, monkeypatch):
    """(``//admin/status`` is a 404 from the daemon's aiohttp; this fake, http.server, would fold the slashes.)"""
    asked, real = [], urllib.request.Request
    monkeypatch.setattr(urllib.request, "Request", lambda url, **kw: asked.append(url) or real(url, **kw))
    server.answer = (200, "application/json", b'{"models": []}')
    code, out, _ = run(capsys, "status", "--json", "-c", fleet(tmp_path), "--admin-url", server.url + "/")
    assert code == 0 and json.loads(out) == {"models": []} and asked == [server.url + "/admin/status"]


@pytest.mark.parametrize("body", [b'{"error": "upstream unavailable"}', b'["bad gateway"]'])
def test_a_proxys_error_that_is_no_openai_error_object_is_shown_as_text(tmp_path, capsys, server, body):
    server.answer = (502, "application/json", body)
    code, _, err = run(capsys, "batch", "-c", fleet(tmp_path), "--url", server.url, "status", "batch_1")
    assert code == 1 and "502" in err and body.decode() in err and "Traceback" not in err, (code, err)


def test_demo_with_nothing_to_serve_says_so_before_starting_the_cluster(tmp_path, capsys, fake_cluster, monkeypatch):
    """Every model at 0 replicas, or needing a vLLM that is not here: an IndexError traceback after the cluster
    was up; now the config's error, and no cluster started."""
    started = fake_cluster(fail=False)
    monkeypatch.setattr(demo, "vllm_available", lambda: False)
    real = {"name": "v", "engine": "vllm", "model_path": str(tmp_path), "replicas": 1, "container": {"enabled": False}}
    code, _, err = run(capsys, "demo", "-c", fleet(tmp_path, models=[real, {**sim("s"), "replicas": 0}]))
    assert code == 2 and "no model would start" in err and "Traceback" not in err and started == [], (code, err)


def test_a_refused_admin_key_says_whose_daemon_and_which_key(tmp_path, capsys, server):
    """(status printed the daemon's raw JSON 401: another fleet's daemon on the port, or no key file here)"""
    server.answer = (401, "application/json", b'{"error": {"message": "Invalid or missing admin key."}}')
    cfg = fleet(tmp_path)
    code, _, err = run(capsys, "status", "-c", cfg, "--admin-url", server.url)
    assert code == 1 and f"the daemon at {server.url} refused the admin key from " in err, err
    assert "admin.key (none)" in err and f"({cfg})? Name the fleet's file with -c" in err, err
    assert "kill -HUP" not in err


def test_a_reload_refused_or_unreachable_says_how_to_reload_a_daemon_whose_admin_key_or_port_changed(
        tmp_path, capsys, server):
    """An operator rotates daemon.admin_api_keys (or moves admin_port) and runs `slurmfleet reload`: the CLI sends
    the new file's key to the daemon that still has the old ones (401), or knocks on the new port; it said only
    "is it the daemon of this fleet?".  It says what reaches that daemon: a SIGHUP to the pid in its lock file."""
    server.answer = (401, "application/json", b'{"error": {"message": "Invalid or missing admin key."}}')
    cfg = fleet(tmp_path, admin_keys=["admin-new"])
    lock = f"$(cat {yaml.safe_load(open(cfg))['state_dir']}/daemon.lock)"
    code, _, err = run(capsys, "reload", "-c", cfg, "--admin-url", server.url)
    assert code == 1 and "refused the admin key from daemon.admin_api_keys" in err and f"kill -HUP {lock}" in err, err
    code, _, err = run(capsys, "reload", "-c", cfg, "--admin-url", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and "cannot reach the daemon" in err and f"kill -HUP {lock}" in err, err


@pytest.mark.skipif(not (demo.VLLM_VENV / "bin" / "vllm").exists(), reason="no .venv-vllm here (.ci/setup-vllm)")
def test_serve_on_the_embedded_fleet_finds_the_vllm_that_setup_made(tmp_path, monkeypatch):
    """`slurmfleet serve` with no fleet file serves the embedded one, whose tiny-llama runs `vllm serve`: as
    `slurmfleet demo` does, .venv-vllm's bin goes on the PATH the jobs get (its job failed "vllm: command not
    found" where vLLM is only there).  With a fleet file of the operator's own, PATH is theirs."""
    import orchestrator.daemon as daemon
    seen: list[str] = []

    class Daemon:
        def __init__(self, path, cfg, cancel_jobs_on_exit=False, settle_gc=False):
            self.path = path

        async def run(self) -> int:
            seen.append((self.path, os.environ["PATH"]))
            return 0
    monkeypatch.setattr(daemon, "Daemon", Daemon)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("SLURMFLEET_CONFIG", raising=False)
    monkeypatch.setenv("SLURMFLEET_STATE_DIR", str(tmp_path / "state"))
    assert cli.main(["serve"]) == 0
    assert seen[-1][0] == str(cli.DEFAULT_CONFIG) and seen[-1][1].split(":")[0] == str(demo.VLLM_VENV / "bin")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli.main(["serve", "-c", fleet(tmp_path)]) == 0
    assert seen[-1][1] == "/usr/bin:/bin"


# refusals: one line on stderr, nothing on stdout

@pytest.mark.parametrize("argv,says", [
    (["drain", "999"], "slurmfleet drain: job 999 is not a replica of this fleet"),
    (["scale", "nope", "2"], "slurmfleet scale: unknown model nope"),
    (["status"], "slurmfleet status: job 999 is not a replica of this fleet"),
])
def test_the_admin_apis_refusal_is_one_line_on_stderr(tmp_path, capsys, server, argv, says):
    """(the raw JSON went to stdout, for a script to take as the answer)"""
    msg = says.split(": ", 1)[1]
    server.answer = (404, "application/json", json.dumps({"error": {"message": msg, "type": "not_found"}}).encode())
    code, out, err = run(capsys, *argv, "-c", fleet(tmp_path), "--admin-url", server.url)
    assert (code, out, err) == (1, "", says + "\n")


@pytest.mark.parametrize("host,want", [("::", "[::1]"), ("", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"),
                                       ("::1", "[::1]"), ("10.0.0.2", "10.0.0.2"), ("admin.example", "admin.example")])
def test_where_the_cli_reaches_a_listener(host, want):
    """admin_host "::" (IPv6 alone: asyncio binds it IPV6_V6ONLY) was dialled at 127.0.0.1 and "" at http://:PORT:
    every admin command failed while the daemon ran."""
    from orchestrator.configchecks import dial_host
    assert dial_host(host) == want


def test_an_admin_api_on_ipv6_alone_is_reached(tmp_path, capsys):
    class V6(ThreadingHTTPServer):
        address_family = socket.AF_INET6
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "11")
            self.end_headers()
            self.wfile.write(b'{"ok":true}')

        def log_message(self, *a):
            pass
    httpd = V6(("::1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        path = pathlib.Path(fleet(tmp_path))
        cfg = yaml.safe_load(path.read_text())
        cfg["daemon"].update(admin_host="::", admin_port=httpd.server_address[1])
        path.write_text(yaml.safe_dump(cfg))
        code, out, err = run(capsys, "drain", "42", "-c", str(path))
        assert code == 0 and seen == ["/admin/drain/42"], (code, err)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_odd_arguments_end_with_a_line_not_a_traceback(tmp_path, capsys):
    code, _, err = run(capsys, "status", "-c", fleet(tmp_path), "--admin-url", "foo")
    assert code == 1 and err.strip() == "--admin-url 'foo' is no URL: unknown url type: 'foo/admin/status'", err
    # a cluster folder that cannot be made (past the port checks: free ports)
    code, _, err = run(capsys, "local-cluster", "up", "--dir", "/proc/nope/cluster", "--ctld-port", str(free_port()),
                       "--slurmd-port-base", str(free_port()))
    assert code == 1 and err.strip() == "local-cluster: No such file or directory: /proc/nope", err
    # an age past 1970 (OverflowError in gmtime): from the beginning
    assert cli._when("9" * 22 + "d", now=1000.0) == 0.0 and cli._when("2d", now=1e6) == 1e6 - 2 * 86400


def test_a_reader_that_left_ends_the_command_quietly(tmp_path):
    """`slurmfleet drain 42 | true`: the drain is done, its answer has nowhere to go (a BrokenPipeError traceback)."""
    import subprocess
    import sys
    s = FakeServer()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # (stdout buffered: flushed at exit)
    try:
        for note in ("x" * 200_000, "x"):   # an answer longer than the pipe holds, and a short one
            s.answer = (200, "application/json", json.dumps({"ok": True, "note": note}).encode())
            r = subprocess.run(f"{sys.executable} -m orchestrator.cli drain 42 -c {fleet(tmp_path)} --admin-url "
                               f"{s.url} | true; echo rc=${{PIPESTATUS[0]}}", shell=True,
                               executable="/bin/bash", capture_output=True, text=True, timeout=60, env=env,
                               cwd=pathlib.Path(__file__).parent.parent)
            assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
            assert r.stdout.strip() == "rc=141", r.stdout
        assert [q[1] for q in s.requests] == ["/admin/drain/42"] * 2
    finally:
        s.close()


def test_a_batch_file_with_a_bad_line_names_it_and_leaves_no_copy(tmp_path, capsys, server, monkeypatch):
    """`batch submit --model` copies the file with the model filled in: a line that is no JSON left the copy in
    /tmp (and its descriptor open), and the message named no line."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)   # (TMPDIR read again)
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n{oops\n')
    code, _, err = run(capsys, "batch", "submit", str(src), "--model", "m", "-c", fleet(tmp_path), "--url",
                       server.url)
    assert code == 1 and f"{src}: line 2 is no JSON" in err and "Traceback" not in err, (code, err)
    assert list((tmp_path / "tmp").iterdir()) == [] and server.requests == []


@pytest.mark.parametrize("n", ["0", "-1", "x"])
def test_a_batch_of_no_shards_is_refused_before_its_file_goes_up(tmp_path, capsys, server, n):
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n')
    code, _, err = run(capsys, "batch", "submit", str(src), "--shards", n, "-c", fleet(tmp_path), "--url", server.url)
    assert code == 2 and "is not a number of shards from 1 to" in err and server.requests == [], (code, err)


@pytest.mark.parametrize("n", ["0", "101", "x"])
def test_a_batch_list_limit_out_of_range_is_one_line(tmp_path, capsys, server, n):
    """It was argparse's choices: the error listed all 100 numbers. Found by a soak."""
    code, _, err = run(capsys, "batch", "list", "--limit", n, "-c", fleet(tmp_path), "--url", server.url)
    assert code == 2 and f"{n!r} is not a number from 1 to 100" in err and len(err) < 400, (code, err)
    assert server.requests == []


@pytest.mark.parametrize("slot", ["-1", "x"])
def test_render_refuses_a_slot_no_daemon_makes(tmp_path, capsys, slot):
    """--slot -1 rendered a job tagged slot=-1 (and, with stagger_s, a shorter time limit). Found by a soak."""
    code, out, err = run(capsys, "render", "m", "-c", fleet(tmp_path, models=[sim("m")]), "--slot", slot)
    assert code == 2 and not out and f"{slot!r} is not a slot" in err, (code, err)
    code, out, _ = run(capsys, "render", "m", "-c", fleet(tmp_path, models=[sim("m")]), "--slot", "2")
    assert code == 0 and "slot=2" in out


def test_an_admin_key_the_cli_cannot_send_is_named(tmp_path, capsys, server, monkeypatch):
    monkeypatch.setenv("SLURMFLEET_ADMIN_KEY", "cl\u00e9\u20ac")
    code, _, err = run(capsys, "status", "-c", fleet(tmp_path), "--admin-url", server.url)
    assert code == 1 and "must be printable ASCII" in err and "cannot reach" not in err, (code, err)


def test_a_reload_says_which_file_the_daemon_read_when_it_is_not_the_one_named(tmp_path, capsys, server):
    """`slurmfleet reload -c other.yaml` reaches the daemon that file names, which reads its own file: it said
    "reload applied" as if other.yaml had been applied."""
    cfg = fleet(tmp_path)
    server.answer = (200, "application/json", json.dumps({"ok": True, "config": "/etc/slurmfleet/prod.yaml",
                                                          "changes": ["model m: replicas 1 -> 2"]}).encode())
    code, out, _ = run(capsys, "reload", "-c", cfg, "--admin-url", server.url)
    assert code == 0 and out == f"reload applied (the daemon read /etc/slurmfleet/prod.yaml, not {cfg})\n" \
                                "  model m: replicas 1 -> 2\n", out
    server.answer = (200, "application/json", json.dumps({"ok": True, "config": cfg, "changes": []}).encode())
    assert run(capsys, "reload", "-c", cfg, "--admin-url", server.url)[1] == "reload applied\n"
