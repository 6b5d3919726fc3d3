"""What a config problem says in an operator's words: each field pattern's rule (pydantic's own message quotes the
regular expression), and every field name the fleet file may use (for an unknown field's "did you mean")."""

from __future__ import annotations

from functools import cache

from pydantic import BaseModel

from .config import NAME_RE, SLURM_WORD_RE, FleetConfig
from .keys import HOST_RE, KEY_NAME_RE

PATTERN_WORDS = {
    NAME_RE: "a name of letters, digits and . _ : / - (at most 128), starting with a letter or digit",
    SLURM_WORD_RE: "one SLURM word: letters, digits and _ . , : + @ % = / - (no spaces or quotes)",
    KEY_NAME_RE: "letters, digits and _ . - (at most 64)",
    r"^[a-z0-9][a-z0-9-]{0,31}$": "lowercase letters, digits and dashes (at most 32), starting with a letter or digit",
    r"^/[^\s'\"\\$`;|&<>%:,#/][^\s'\"\\$`;|&<>%:,#]*$": "an absolute path without spaces, quotes or any of "
                                                        "$ ` ; | & < > % : , # \\ (job scripts and sbatch options "
                                                        "carry it as it is)",
    HOST_RE: "an address or a host name (no scheme, no port)",
    r"^[A-Za-z0-9_.,:&|*\[\]()!-]+$": "sbatch --constraint's syntax: features joined by & | , with brackets, no "
                                      "spaces",
    r"^[A-Za-z0-9_.-]+$": "letters, digits and _ . -",
    r"^[A-Za-z_][A-Za-z0-9_]*$": "an environment variable's name: letters, digits and _, not starting with a digit",
    r"^[a-z0-9][a-z0-9-]*$": "a vLLM flag's long name without its dashes, in lowercase with dashes between words "
                             "(served-model-name, not --served-model-name nor served_model_name)",
}


@cache
def field_names() -> frozenset[str]:
    """The names of every field of the fleet file's sections (a near miss of one is said)."""
    out: set[str] = set()

    def walk(model: type[BaseModel]) -> None:
        for name, f in model.model_fields.items():
            out.add(name)
            for t in (f.annotation, *getattr(f.annotation, "__args__", ())):
                if isinstance(t, type) and issubclass(t, BaseModel) and t is not model:
                    walk(t)
    walk(FleetConfig)
    return frozenset(out)
