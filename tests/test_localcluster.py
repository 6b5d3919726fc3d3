"""The local cluster's settings, without starting it: the release from ``slurmd -V``, the cgroup.conf decision on
both releases, the rendered config for given ports and directory, and the flags and environment that set them.

(Starting a second cluster on other ports and another directory is what ``.ci/other-release`` does, in a root
of the other Debian release.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_for
from orchestrator import cli
from orchestrator.devtools import localcluster
from orchestrator.devtools.localcluster import ClusterError, LocalCluster
from orchestrator.devtools.slurmrelease import SlurmRelease, cgroup_conf, parse_slurm_version

CAPTURED_CGROUP_CONF = Path(__file__).parent / "data" / "slurm-captures" / "24.11" / "cgroup.conf"
R2205, R2411 = SlurmRelease(22, 5, 8), SlurmRelease(24, 11, 5)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (localcluster.ENV_DIR, localcluster.ENV_CTLD_PORT, localcluster.ENV_SLURMD_PORT_BASE):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def settings(text: str) -> dict[str, str]:
    """key=value lines of a SLURM config (comments dropped; NodeName/PartitionName lines keyed by name)."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        if key in ("NodeName", "PartitionName"):
            key = f"{key}={value.split()[0]}"
        out[key] = value
    return out


@pytest.mark.parametrize("text,release", [
    ("slurm-wlm 24.11.5\n", R2411),        # Debian 13
    ("slurm-wlm 22.05.8\n", R2205),        # Debian 12
    ("slurm 23.11.10", SlurmRelease(23, 11, 10)),  # an upstream build
    ("slurm 24.05.0-0rc1", SlurmRelease(24, 5, 0)),
    ("slurm 25.05", SlurmRelease(25, 5, 0)),
    ("slurmd: error: something else", None),
    ("", None),
])
def test_version_from_slurmd_v(text, release):
    assert parse_slurm_version(text) == release


def test_release_prints_as_slurm_does():
    assert (str(R2205), str(R2411), str(SlurmRelease(24, 5, 0))) == ("22.05.8", "24.11.5", "24.05.0")


@pytest.mark.parametrize("release,disabled", [
    (R2205, False), (SlurmRelease(23, 2, 7), False), (SlurmRelease(23, 11, 10), False),
    (SlurmRelease(24, 5, 0), True), (R2411, True), (SlurmRelease(25, 5, 1), True), (None, False),
])
def test_cgroup_plugin_disabled_from_2405_only(release, disabled):
    text = cgroup_conf(release)
    assert (text is not None) == disabled
    if disabled:
        assert "CgroupPlugin=disabled" in text.splitlines()


def test_rendered_files_per_release_match_what_ran_on_2411(tmp_path):
    c = LocalCluster(tmp_path / "c", ctld_port=16817, slurmd_base_port=16900)
    on_2205, on_2411 = c.render("h", R2205), c.render("h", R2411)
    assert set(on_2205) == {"slurm.conf", "gres.conf"}  # 22.05 rejects CgroupPlugin=disabled: no file
    assert set(on_2411) == {"slurm.conf", "gres.conf", "cgroup.conf"}
    # the one line the captures' 24.11 cluster ran with
    captured = [ln for ln in CAPTURED_CGROUP_CONF.read_text().splitlines() if ln and not ln.startswith("#")]
    assert [ln for ln in on_2411["cgroup.conf"].splitlines() if not ln.startswith("#")] == captured
    # otherwise the same cluster on both
    assert settings(on_2205["slurm.conf"]) == settings(on_2411["slurm.conf"])
    assert on_2205["slurm.conf"].startswith("# written by slurmfleet local-cluster for Slurm 22.05.8")


def test_rendered_config_follows_ports_and_directory(tmp_path):
    root = tmp_path / "other"
    c = LocalCluster(root, nodes=3, gpus_per_node=2, ctld_port=17817, slurmd_base_port=17900)
    files = c.render("myhost", R2411)
    conf = settings(files["slurm.conf"])
    assert conf["SlurmctldPort"] == "17817" and conf["SlurmctldHost"] == "myhost(127.0.0.1)"
    for i, kind in ((1, "a100"), (2, "h100"), (3, "a100")):   # typed fake GPUs, each node's type its feature
        node = conf[f"NodeName=node{i}"].split()
        assert f"Port={17900 + i}" in node and "NodeHostname=myhost" in node and f"Gres=gpu:{kind}:2" in node
        assert f"Feature={kind}" in node
    assert conf["AuthInfo"] == f"socket={root}/munge/munge.sock,cred_expire=10"
    for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdPidFile", "SlurmctldLogFile",
                "SlurmdLogFile"):
        assert conf[key].startswith(f"{root}/"), key
    assert files["gres.conf"] == "".join(f"NodeName=node{i} Name=gpu Type={kind} File={root}/dev/gpu[0-1]\n"
                                         for i, kind in ((1, "a100"), (2, "h100"), (3, "a100")))
    assert c.slurmd_ports == [17901, 17902, 17903] and c.conf == root / "etc" / "slurm.conf"
    one = settings(LocalCluster(root, nodes=1, gpus_per_node=1, ctld_port=1234, slurmd_base_port=2000)
                   .render("h", R2205)["slurm.conf"])
    assert "Port=2001" in one["NodeName=node1"].split() and one["SlurmctldPort"] == "1234"


def test_daemons_own_pid_files_are_not_the_spawn_records(tmp_path):
    # slurmctld truncates SlurmctldPidFile before it writes it: had it been local-cluster's own record, a wait
    # reading it in between called the starting slurmctld dead (a CI run failed so)
    c = LocalCluster(tmp_path, nodes=2)
    conf = settings(c.render("h", R2205)["slurm.conf"])
    written_by_slurm = {Path(conf["SlurmctldPidFile"])} | {
        Path(conf["SlurmdPidFile"].replace("%n", n)) for n in c.node_names}
    records = {c._pidfile(name) for name in c._daemon_names()}
    assert len(records) == 4 and not written_by_slurm & records


def test_defaults_unchanged(clean_env):
    c = LocalCluster()
    assert c.root == Path(f"/tmp/slurmfleet-cluster-{os.getuid()}")
    assert (c.ctld_port, c.slurmd_ports, c.nodes, c.gpus_per_node) == (16817, [16901, 16902, 16903, 16904], 4, 4)


def test_environment_sets_directory_and_ports_and_arguments_win(clean_env, tmp_path):
    clean_env.setenv("SLURMFLEET_CLUSTER_DIR", str(tmp_path / "env"))
    clean_env.setenv("SLURMFLEET_CLUSTER_CTLD_PORT", "17817")
    clean_env.setenv("SLURMFLEET_CLUSTER_SLURMD_PORT_BASE", "17900")
    c = LocalCluster()
    assert (c.root, c.ctld_port, c.slurmd_ports[0]) == (tmp_path / "env", 17817, 17901)
    assert c.env()["SLURM_CONF"] == str(tmp_path / "env" / "etc" / "slurm.conf")
    c = LocalCluster(tmp_path / "arg", ctld_port=18817)
    assert (c.root, c.ctld_port, c.slurmd_ports[0]) == (tmp_path / "arg", 18817, 17901)


@pytest.mark.parametrize("env,kw,message", [
    ({"SLURMFLEET_CLUSTER_CTLD_PORT": "abc"}, {}, "is not a port number"),
    ({"SLURMFLEET_CLUSTER_CTLD_PORT": "99999"}, {}, r"\$SLURMFLEET_CLUSTER_CTLD_PORT='99999' is not a port number"),
    ({"SLURMFLEET_CLUSTER_SLURMD_PORT_BASE": "-5"}, {}, r"\$SLURMFLEET_CLUSTER_SLURMD_PORT_BASE='-5' is not a port"),
    ({}, {"ctld_port": 70000}, "is not a port number"),
    ({}, {"slurmd_base_port": 65534}, "are not port numbers"),
    ({}, {"ctld_port": 16902}, "is one of the slurmd ports"),
])
def test_bad_settings_are_refused(clean_env, env, kw, message):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ClusterError, match=message):
        LocalCluster(**kw)


def test_cli_flags_reach_the_cluster_and_status_names_the_release(clean_env, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(localcluster, "detect_release", lambda slurmd=None: R2411)
    clean_env.setenv("SLURMFLEET_CLUSTER_CTLD_PORT", "19817")  # the flag below wins
    args = cli.build_parser().parse_args(["local-cluster", "status", "--dir", str(tmp_path / "d"),
                                          "--ctld-port", "18817", "--slurmd-port-base", "18900", "--nodes", "2"])
    assert cli.cmd_local_cluster(args) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["release"] == "24.11.5" and st["slurmctld_port"] == 18817 and st["slurmd_ports"] == [18901, 18902]
    assert st["dir"] == str(tmp_path / "d") and st["slurm_conf"] == str(tmp_path / "d" / "etc" / "slurm.conf")
    assert st["daemons"] == {"munged": None, "slurmctld": None, "slurmd-node1": None, "slurmd-node2": None}
    assert st["nodes"] == []
    args = cli.build_parser().parse_args(["local-cluster", "status", "--ctld-port", "16901"])
    assert cli.cmd_local_cluster(args) == 1 and "is one of the slurmd ports" in capsys.readouterr().err


def test_help_names_the_environment(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["local-cluster", "--help"])
    out = capsys.readouterr().out
    for name in ("SLURMFLEET_CLUSTER_DIR", "SLURMFLEET_CLUSTER_CTLD_PORT", "SLURMFLEET_CLUSTER_SLURMD_PORT_BASE",
                 "--ctld-port", "--slurmd-port-base", "24.11", "22.05"):
        assert name in out


def test_describe_says_which_release_and_where(tmp_path, monkeypatch):
    monkeypatch.setattr(localcluster, "detect_release", lambda slurmd=None: R2205)
    c = LocalCluster(tmp_path, ctld_port=17817, slurmd_base_port=17900)
    assert c.describe() == (f"Slurm 22.05.8, 4 nodes x 4 GPUs (a100/h100), slurmctld port 17817, slurmd ports 17901-17904, "
                            f"dir {tmp_path}")


@pytest.mark.skipif(os.geteuid() != 0, reason="writes device nodes (root)")
def test_written_files_follow_the_release_and_a_stale_cgroup_conf_goes(tmp_path, monkeypatch):
    c = LocalCluster(tmp_path / "c", nodes=2, gpus_per_node=2, ctld_port=17817, slurmd_base_port=17900)
    monkeypatch.setattr(localcluster, "detect_release", lambda slurmd=None: R2411)
    c._write_files()
    etc = tmp_path / "c" / "etc"
    assert sorted(p.name for p in etc.iterdir()) == ["cgroup.conf", "gres.conf", "slurm.conf"]
    assert (tmp_path / "c" / "env").read_text() == f"export SLURM_CONF={etc / 'slurm.conf'}\n"
    # the same directory on 22.05 (a root of the other release, say): our cgroup.conf would stop slurmd
    c22 = LocalCluster(tmp_path / "c", nodes=2, gpus_per_node=2, ctld_port=17817, slurmd_base_port=17900)
    monkeypatch.setattr(localcluster, "detect_release", lambda slurmd=None: R2205)
    c22._write_files()
    assert sorted(p.name for p in etc.iterdir()) == ["gres.conf", "slurm.conf"]
    (etc / "cgroup.conf").write_text("CgroupPlugin=cgroup/v2\n")  # not ours: left alone
    c22._write_files()
    assert (etc / "cgroup.conf").read_text() == "CgroupPlugin=cgroup/v2\n"


def test_up_refuses_a_port_another_program_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(localcluster.shutil, "which", lambda tool: f"/usr/bin/{tool}")  # no SLURM needed here
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        c = LocalCluster(tmp_path / "c", ctld_port=port, slurmd_base_port=port + 10)
        with pytest.raises(ClusterError, match=f"port {port} .*--ctld-port or \\$SLURMFLEET_CLUSTER_CTLD_PORT"):
            c.up()
    assert not (tmp_path / "c").exists()  # refused before writing or starting anything


@pytest.mark.cluster
def test_the_running_cluster_names_this_hosts_release_and_has_cgroup_conf_where_needed(cluster):
    """On the host's own Slurm and, in .ci/other-release, on the other Debian release's."""
    out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=15, check=True).stdout
    release = parse_slurm_version(out)
    assert release is not None and cluster.status()["release"] == str(release)
    assert (cluster.conf.parent / "cgroup.conf").exists() == release.disables_cgroup_plugin
    assert f"SlurmctldPort={cluster.ctld_port}\n" in cluster.conf.read_text()


def test_a_pid_file_naming_another_process_is_not_a_cluster_daemon(tmp_path):
    """A stale pid file (a reboot that kept /tmp, a daemon that died and its pid reused): `status` called the
    process there the cluster's munged, `up` would not start the real one, and `down` SIGTERMed and SIGKILLed it."""
    import subprocess
    c = LocalCluster(tmp_path / "c", nodes=1, ctld_port=16818, slurmd_base_port=16950)
    (tmp_path / "c" / "run").mkdir(parents=True)
    other = subprocess.Popen(["sleep", "300"])
    ours = subprocess.Popen(["sh", "-c", "sleep 300", str(tmp_path / "c")])   # (the cluster's root in its argv)
    try:
        for name, p in (("munged", other), ("slurmd-node1", ours)):
            (tmp_path / "c" / "run" / f"{name}.pid").write_text(f"{p.pid}\n")
        cmdline = Path(f"/proc/{ours.pid}/cmdline")   # (until its exec, a fork's command line is this test's own)
        wait_for(lambda: str(tmp_path / "c").encode() in cmdline.read_bytes(), 10, "the child's exec")
        assert c.status()["daemons"] == {"munged": None, "slurmctld": None, "slurmd-node1": ours.pid}
        assert c.down(timeout_s=5) == ["slurmd-node1"] and other.poll() is None
    finally:
        for p in (other, ours):
            p.kill()
            p.wait()


def test_a_folder_that_is_not_this_users_own_is_refused(tmp_path):
    """Under /tmp another user may make the cluster's folder first (its munge key, its slurm.conf, links to files
    root would overwrite): ``up`` refuses it, and writes nothing there."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ClusterError, match="not a folder of this user's"):
        LocalCluster(tmp_path / "link", ctld_port=16817, slurmd_base_port=16900)._write_files()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    if os.geteuid() == 0:   # (a folder of another user's: only root can make one here)
        theirs = tmp_path / "theirs"
        (theirs / "munge").mkdir(parents=True)
        os.chown(theirs / "munge", 65534, 65534)
        with pytest.raises(ClusterError, match="munge is not a folder of this user's"):
            LocalCluster(theirs, ctld_port=16817, slurmd_base_port=16900)._write_files()
        assert not (theirs / "munge" / "munge.key").exists()


@pytest.mark.cluster
def test_down_ends_the_clusters_jobs_before_its_daemons(tmp_path, cluster):
    """`down` stopped the daemons and left the jobs' processes (the demo's vLLM engine, its simulators)
    running for good: with slurmctld gone nothing would end them.  A second cluster of its own, beside the
    suite's."""
    c = LocalCluster(tmp_path / "c", nodes=1, gpus_per_node=1, ctld_port=16827, slurmd_base_port=16970)
    marker = f"sleep {3000 + os.getpid() % 1000}.5"
    try:
        c.up()
        r = subprocess.run(["sbatch", "-o", str(tmp_path / "out"), "--wrap", marker], env=c.env(), capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        running = lambda: subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0  # noqa: E731
        wait_for(running, 30, "the job's process")
        stopped = c.down()
        assert stopped[0] == "1 jobs" and "slurmctld" in stopped and not running(), stopped
    finally:
        c.down()


def _fake_daemons(tmp_path, monkeypatch, ctld_deaths: int) -> LocalCluster:
    """A cluster whose daemons are scripts: slurmctld writes a fatal line to its log and exits, ``ctld_deaths``
    times, and then stays up; the others stay up."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    root = tmp_path / "c"
    stay = f"exec {sys.executable} -c 'import signal; signal.pause()' \"$0\" \"$@\"\n"   # (until down; argv keeps the root)
    (bin_ / "slurmctld").write_text(
        f"#!/bin/sh\nn=$(ls {root}/deaths 2>/dev/null | wc -l)\nif [ $n -lt {ctld_deaths} ]; then\n"
        f"  touch {root}/deaths/$$; echo \"fatal: Unable to bind listen port ($n)\" >> {root}/log/slurmctld.log\n"
        f"  echo 'slurmctld: fatal: see the log' ; exit 1\nfi\n{stay}")
    for tool in ("munged", "slurmd"):
        (bin_ / tool).write_text(f"#!/bin/sh\n{stay}")
    for f in bin_.iterdir():
        f.chmod(0o755)
    (root / "deaths").mkdir(parents=True)
    monkeypatch.setattr(localcluster, "_exe", lambda tool: str(bin_ / tool))
    monkeypatch.setattr(localcluster.shutil, "which", lambda tool: str(bin_ / tool))
    ok = subprocess.CompletedProcess([], 0, b"", b"")
    monkeypatch.setattr(LocalCluster, "_run", lambda self, argv: ok)
    monkeypatch.setattr(LocalCluster, "_munge_answers", lambda self: True)
    monkeypatch.setattr(LocalCluster, "_all_idle_or_alloc", lambda self: True)
    monkeypatch.setattr(LocalCluster, "release", None)
    up = lambda self: self._alive("slurmctld") is not None and len(list((root / "deaths").iterdir())) >= ctld_deaths  # noqa: E731
    monkeypatch.setattr(LocalCluster, "_ctld_up", up)
    base = 18500 + os.getpid() % 400   # (nothing listens: the daemons are scripts; the check only binds)
    return LocalCluster(root, nodes=1, gpus_per_node=1, ctld_port=base, slurmd_base_port=base + 1)


def test_a_daemon_that_dies_at_its_start_fails_up_with_its_own_logs_last_lines(tmp_path, monkeypatch):
    """The error said only "see the log": slurmctld says why in its own log file, which is read now."""
    c = _fake_daemons(tmp_path, monkeypatch, ctld_deaths=1)
    try:
        with pytest.raises(localcluster.DaemonExited) as e:
            c.up(timeout_s=10)
        assert "slurmctld.log ends: fatal: Unable to bind listen port (0)" in str(e.value) \
            and "its output ends: slurmctld: fatal: see the log" in str(e.value), str(e.value)
    finally:
        c.down(timeout_s=5)


def test_a_daemon_whose_exec_is_under_way_is_not_called_dead(tmp_path, monkeypatch):
    """The kernel sets a new program's command line up after the close-on-exec that lets Popen return: read in
    that moment (a loaded machine widens it) it is empty, and `up` called a daemon it had just started dead
    ("munged exited while waiting for munged", no last words: CI, several times)."""
    c = LocalCluster(tmp_path / "c", nodes=1, gpus_per_node=1, ctld_port=18817, slurmd_base_port=18900)
    (tmp_path / "c" / "run").mkdir(parents=True)
    p = subprocess.Popen(["sh", "-c", "sleep 30", str(tmp_path / "c")])
    reads = [b"", b"", b"sh\x00-c\x00sleep 30\x00" + str(tmp_path / "c").encode() + b"\x00"]
    real = Path.read_bytes

    def cmdline(self):   # (the first reads in the exec's moment)
        return reads.pop(0) if self.name == "cmdline" and reads else real(self)
    try:
        (tmp_path / "c" / "run" / "munged.pid").write_text(f"{p.pid}\n")
        monkeypatch.setattr(Path, "read_bytes", cmdline)
        assert c._alive("munged") == p.pid and not reads
    finally:
        p.kill()
        p.wait()


def test_down_tries_squeue_again_and_says_when_it_could_not_list_the_jobs(tmp_path, monkeypatch):
    """`down` took a failed squeue (a busy slurmctld timing it out) for no jobs, stopped the daemons and left the
    jobs' processes running with nothing to end them, and said nothing of it."""
    c = _fake_daemons(tmp_path, monkeypatch, ctld_deaths=0)
    c.up(timeout_s=10)
    calls: list[list[str]] = []
    answers = {"squeue": [(124, b"", b"timeout"), (0, b"12\n13\n", b""), (0, b"", b"")], "scancel": [(0, b"", b"")]}

    def run(self, argv):
        calls.append(argv)
        rc, out, err = answers[argv[0]].pop(0) if argv[0] in answers else (0, b"", b"")   # (up's scontrol)
        return subprocess.CompletedProcess(argv, rc, out, err)
    monkeypatch.setattr(LocalCluster, "_run", run)
    stopped = c.down(timeout_s=5)
    assert stopped[0] == "2 jobs" and ["scancel", "12", "13"] in calls and "slurmctld" in stopped, (stopped, calls)
    c.up(timeout_s=10)
    answers["squeue"] = [(1, b"", b"slurm_load_jobs error: Socket timed out")] * 3
    stopped = c.down(timeout_s=5)
    assert stopped[0] == "its jobs unknown (squeue: slurm_load_jobs error: Socket timed out)", stopped
    assert "slurmctld" in stopped and [a[0] for a in calls].count("scancel") == 1
