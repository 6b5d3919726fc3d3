"""The fields vLLM's whole (not streamed) answers carry, null or not (it dumps its response model whole): what an
answer the gateway rebuilds from a stream, or the simulator writes, carries beside its values.  A real-vLLM test
(``tests/test_vllm_e2e.py``) compares the fields of an answer through the gateway with the replica's own."""

from __future__ import annotations

MESSAGE = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}
CHOICE = {"routed_experts": None}
RESPONSE = {"service_tier": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
CHAT_RESPONSE = {"prompt_text": None}   # (a chat's, beside its prompt_logprobs and prompt_token_ids)


def usage(counts: dict) -> dict:
    """A whole answer's usage: ``counts`` with the details vLLM's has, null unless given."""
    return {"prompt_tokens_details": None, **counts, "completion_tokens_details": None}
