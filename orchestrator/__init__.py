"""slurmfleet: keep vLLM replicas alive as SLURM jobs behind one OpenAI-compatible gateway."""

__version__ = "0.1.0"
