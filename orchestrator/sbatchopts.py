"""``cluster.sbatch_options``: which sbatch options a fleet file may add to its jobs' ``#SBATCH`` lines, and
what is wrong with each one it may not add (each told at its own key, all at once)."""

from __future__ import annotations

import re
from typing import Any

from .configchecks import FieldError, reserved_sbatch_problem

SLURM_WORD_RE = r"^[A-Za-z0-9_.,:+@%=/-]+$"
RESERVED_SBATCH = {
    "job-name", "J", "comment", "output", "o", "error", "e", "nodes", "N", "gres", "gpus", "gpus-per-node", "time",
    "t", "signal", "partition", "p", "account", "A", "qos", "q", "parsable", "wrap", "exclude", "x", "requeue",
    "no-requeue", "ntasks-per-node", "tasks-per-node", "cpus-per-task", "c", "mem", "reservation", "constraint", "C",
    "cpus-per-gpu", "ntasks-per-gpu",   # (sbatch: exclusive with --cpus-per-task, --ntasks-per-node, always written)
}
# sbatch options that change what a job is, so the daemon's one-job-per-replica view would break:
# arrays (many jobs), dependencies and holds (a job that never starts), another script, waiting
# sbatch calls, a different user, group, directory, input or environment, a later start, no job at all
# (help, usage, version), another cluster (squeue and scancel without -M never see it: resubmitted forever)
FORBIDDEN_SBATCH = {
    "array", "a", "dependency", "d", "kill-on-invalid-dep", "hold", "H", "test-only", "wait", "W", "batch", "uid",
    "gid", "chdir", "D", "input", "i", "export", "export-file", "get-user-env", "begin", "b", "deadline", "no-kill",
    "k", "open-mode", "ntasks", "n", "ntasks-per-core", "ntasks-per-socket", "het-group", "container", "container-id",
    "reboot", "help", "usage", "version", "V", "clusters", "M", "cluster-constraint",
}

# sbatch's long options (22.05, `man sbatch`) that a bare `#SBATCH --key` may be: they take no value or an optional
# one (`--exclusive[=user|mcs]`, `--nice[=N]`, `--propagate[=...]`); the reserved and forbidden ones are refused above
SBATCH_FLAGS = {"contiguous", "exclusive", "ignore-pbs", "nice", "overcommit", "oversubscribe", "propagate", "quiet",
                "spread-job", "use-min-nodes", "verbose"}
# and those that need a value: written bare, sbatch takes the next #SBATCH line (`--exclusive`) as it
SBATCH_VALUED = set("""acctg-freq bb bbf comment core-spec cores-per-socket cpu-freq delay-boot distribution
    extra-node-info gpu-bind gpu-freq gpus-per-socket gpus-per-task gres-flags hint licenses mail-type mail-user
    mcs-label mem-bind mem-per-cpu mem-per-gpu mincpus network nodefile nodelist power prefer priority profile
    sockets-per-node switches thread-spec threads-per-core time-min tmp wait-all-nodes wckey""".split())


def sbatch_option_problems(options: dict[str, Any]) -> list[FieldError]:
    """What is wrong with each of ``cluster.sbatch_options``, at its own key (a wrong name) or value."""
    out = []
    for key, val in options.items():
        if why := _name_problem(key):
            out.append(FieldError((key,), why, at_key=True))
        elif val is True and (why := _bare_problem(key)):
            out.append(FieldError((key,), why, at_key=True))
        elif val is False:
            out.append(FieldError((key,), f"sbatch option {key!r}: false is not allowed; omit the option"))
        elif not isinstance(val, bool) and not re.fullmatch(SLURM_WORD_RE, str(val)):
            out.append(FieldError((key,), f"sbatch option {key!r} value {val!r} may not contain spaces, quotes or "
                                          "newlines"))
    return out


def _name_problem(key: str) -> str | None:
    if not re.fullmatch(r"[a-z][a-z0-9-]*", key):   # (match and $ let a last newline through)
        return f"sbatch option {key!r} must be a long option name like 'mail-type'"
    if key in RESERVED_SBATCH:
        return reserved_sbatch_problem(key)
    if key in FORBIDDEN_SBATCH:
        return f"sbatch option {key!r} would change what a replica's job is; it is not allowed"
    whole = next((n for n in sorted(RESERVED_SBATCH | FORBIDDEN_SBATCH) if len(n) > 1 and n.startswith(key)), None)
    if whole is not None:   # (sbatch takes any unambiguous start of a long option as the option)
        return (f"sbatch option {key!r} abbreviates {whole!r}, which sbatch would read it as; {whole!r} is not allowed "
                "here")
    return None


def _bare_problem(key: str) -> str | None:
    """Why ``key: true`` (a bare ``#SBATCH --key``) is wrong, or None: an option that needs a value (or one this
    table does not know) took the next ``#SBATCH`` line as its value (``--mail-user`` then ``--exclusive``)."""
    meant = [key] if key in SBATCH_FLAGS | SBATCH_VALUED else \
        [n for n in sorted(SBATCH_FLAGS | SBATCH_VALUED) if n.startswith(key)]   # (a start of one: sbatch reads it)
    if len(meant) == 1 and meant[0] in SBATCH_FLAGS:
        return None
    flags = ", ".join(sorted(SBATCH_FLAGS))
    if len(meant) > 1:
        return f"sbatch option {key!r} starts several ({', '.join(meant)}), which sbatch refuses: write one whole"
    if not meant:
        return (f"sbatch option {key!r} is none that takes no value: true writes a bare --{key}, which is only for "
                f"{flags} (or a start of one); write {key}: VALUE")
    whole = f" (a start of {meant[0]!r})" if meant[0] != key else ""
    return (f"sbatch option {key!r}{whole} needs a value: true writes a bare --{key}, and sbatch would take the next "
            f"#SBATCH line as its value; write {key}: VALUE (true is for {flags}, or a start of one)")
