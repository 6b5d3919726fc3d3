"""Jobs shown to SLURM before they are needed: ``sbatch --test-only`` on a model's rendered job.

A reload that changes a model's job shape cancels its replicas still starting (READY ones serve until their
successors are): if SLURM then refused the new job (a partition mistyped, more GPUs than a node has), the model
would have lost them for a job that never comes.  So a reload shows each changed job to SLURM first, and a job
SLURM refuses makes it refuse the whole reload, the fleet unchanged.  ``--test-only`` submits nothing: it
answers with an estimated start (rc 0) or the reason it would refuse (22.05 and 24.11 alike).

Two answers are ambiguous: "Requested node configuration is not available" means a request no node can meet
(16 GPUs on nodes of 4), but ``--test-only`` also gives it while the nodes that could are down or drained,
where a real sbatch takes the job and it waits; "job submit limit" means the user's job count (it frees as
jobs end) or a job too large for the QOS.  So for those the model's current job is asked too: if SLURM takes
it, the new shape is what it refuses (the reload is refused); if not, the cluster's state is (a warning).  A
model the reload adds has no current job: the same warning.  A controller that cannot be reached refuses
nothing either (a warning); the reconciler's own handling of a refused sbatch applies then, as without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re

from ..config import FleetConfig, ModelConfig
from ..yamlsrc import ConfigError, Source
from .render import Renderer
from .replica import refused_for_now
from .slurm import CliSlurm, SlurmError

log = logging.getLogger("slurmfleet")

# what --test-only answers both for a request no node can meet and for nodes down or drained now
NODES_NOW = re.compile(r"requested node configuration is not available|memory specification can not be satisfied|"
                       r"partition configuration not available now|required node not available", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Verdict:
    index: int        # the model's place in ``models``
    model: str
    refused: bool     # True: SLURM refuses the job; False: it could not be asked or place it now (the text says)
    message: str


def changed(old: FleetConfig, new: FleetConfig) -> list[tuple[int, ModelConfig, ModelConfig | None]]:
    """(place in ``models``, the model, as it is now or None) for each model of ``new`` whose job a reload from
    ``old`` submits anew: added, or its job shape changed."""
    before = {m.name: m for m in old.models}
    return [(i, m, before.get(m.name)) for i, m in enumerate(new.models)
            if m.name not in before or before[m.name].job_hash() != m.job_hash()]


async def check(slurm, renderer: Renderer, old: FleetConfig, new: FleetConfig) -> list[Verdict]:
    """SLURM's verdict on the job of each model :func:`changed` lists (slot 0, as the reconciler renders it), all
    asked at once; only the jobs SLURM refuses or could not judge are returned."""
    async def ask(cfg: FleetConfig, m: ModelConfig) -> SlurmError | None:
        try:
            await slurm.will_run(renderer.render(cfg, m, 0, "preflight"))
        except SlurmError as exc:
            return exc
        return None

    async def one(i: int, m: ModelConfig, before: ModelConfig | None) -> Verdict | None:
        exc = await ask(new, m)
        if exc is None:
            return None
        text = "; ".join(x.strip().removeprefix("sbatch: ") for x in str(exc).splitlines() if x.strip())
        if exc.transient or not exc.started:
            return Verdict(i, m.name, False, f"SLURM could not be asked: {text}")
        cause = refused_for_now(text)
        why = "SLURM takes no more jobs of this user or QOS now" if cause == "submit_limit" else \
            "SLURM cannot place it on the nodes up now" if NODES_NOW.search(text) else \
            "its partition takes no new jobs now (drained or inactive)" if cause == "partition_closed" else None
        # (a partition drained or inactive exists and opens again: a warning, whatever the current job's answer)
        if why is None or (cause != "partition_closed" and before is not None and await ask(old, before) is None):
            return Verdict(i, m.name, True, text if why is None else f"{text}, where its current job fits")
        return Verdict(i, m.name, False, f"{why}: {text}")

    return [v for v in await asyncio.gather(*(one(*c) for c in changed(old, new))) if v is not None]


async def vet_reload(slurm, renderer: Renderer, old: FleetConfig, new: FleetConfig, src: Source,
                     after: str = "applied without SLURM's check") -> list[str]:
    """Before a reload applies: a ConfigError at each model whose new job SLURM refuses (so nothing applies),
    else the warnings of the jobs SLURM could not judge (logged, but by ``validate``, which prints them)."""
    verdicts = await check(slurm, renderer, old, new)
    if refused := [v for v in verdicts if v.refused]:
        raise ConfigError([src.problem(("models", v.index), f"SLURM refuses model {v.model}'s job (sbatch "
                                                            f"--test-only): {v.message}") for v in refused])
    warnings = [f"model {v.model}: {v.message}; {after}" for v in verdicts]
    for w in warnings if after.startswith("applied") else ():
        log.warning("%s", w)
    return warnings


async def vet_file(cfg: FleetConfig, src: Source) -> list[str]:
    """``slurmfleet validate --slurm``: :func:`vet_reload` for every model of the file, as if it were new."""
    slurm = CliSlurm(cfg.job_name, cfg.cluster.slurm_conf, cfg.cluster.command_timeout_s)
    return await vet_reload(slurm, Renderer(), cfg.model_copy(update={"models": []}), cfg, src,
                            "SLURM did not judge its job")
