"""The simulator's ``vllm run-batch``: what a dedicated-mode batch task runs for ``engine: simulator``.

``python -m orchestrator.devtools.simbatch [MODEL] -i IN.jsonl -o OUT.jsonl --served-model-name NAME`` reads
the OpenAI batch input (one ``{"custom_id", "method", "url", "body"}`` a line) and writes one line per input
line, in input order, in ``vllm run-batch``'s output format (vLLM 0.32, ``BatchRequestOutput``)::

    {"id": "vllm-<hex>", "custom_id": ..., "response": {"status_code": 200, "request_id": "vllm-batch-<hex>",
     "body": {...chat.completion...}}, "error": null}

and, for a request vLLM refuses, ``status_code`` 4xx, ``body`` null and ``error`` vLLM's ``ErrorResponse``
(``{"error": {"message", "type", "param", "code"}}``) or, for an endpoint run-batch does not serve, a string.
Like vLLM it serves ``/v1/chat/completions`` and ``/v1/embeddings`` (not ``/v1/completions``), refuses
``stream``, and fails the whole run (exit 1) on a line that is not a batch request.  Text and usage are the
simulator's deterministic tokens (``simvocab``; a model directory gives that model's tokenizer), paced as the
simulator paces them (``--ttft-s``, ``--tokens-per-s``, at most ``--max-num-seqs`` at once).  Unlike vLLM,
which writes its output when the whole shard is done, lines are written (and flushed) as soon as every line
before them is answered, and a progress line in vLLM's format goes to stderr after each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid

from orchestrator.devtools import simlogprobs
from orchestrator.devtools.simengine import MAX_MODEL_LEN, max_tokens_of, model_len
from orchestrator.devtools.simgen import choice_body, choices_of
from orchestrator.devtools.simstop import Stops
from orchestrator.devtools.simulator import lora_module
from orchestrator.devtools.simvocab import Adapted, ModelVocab, SimVocab

SUPPORTED = ("/v1/chat/completions", "/v1/embeddings")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.devtools.simbatch", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="a model directory with a tokenizer.json (else simtokens' vocabulary)")
    p.add_argument("-i", "--input-file", required=True)
    p.add_argument("-o", "--output-file", required=True)
    p.add_argument("--served-model-name", nargs="+", action="extend")
    p.add_argument("--ttft-s", type=float, default=0.05)
    p.add_argument("--tokens-per-s", type=float, default=200.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, help="as the simulator's: else config.json's, else 4096")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, help="as the simulator's: NAME=PATH each")
    args, _unknown = p.parse_known_args(argv)  # the rest of the simulator's (and vLLM's) flags
    return args


def _error(status: int, message: str, etype: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


def output_line(custom_id: str, status: int, body: dict | None, error) -> dict:
    return {"id": f"vllm-{uuid.uuid4().hex[:16]}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"vllm-batch-{uuid.uuid4().hex[:16]}", "body": body},
            "error": error}


class SimBatch:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.names = args.served_model_name or [args.model or "sim-model"]
        self.adapters = dict(args.lora_modules or ()) if args.enable_lora else {}
        self.vocab = ModelVocab.load(args.model) or SimVocab()
        self.max_model_len = args.max_model_len or model_len(args.model) or MAX_MODEL_LEN
        self.slots = asyncio.Semaphore(max(1, args.max_num_seqs))

    async def answer(self, req: dict) -> dict:
        cid, url, body = req["custom_id"], req["url"], req["body"]
        if url not in SUPPORTED:
            return output_line(cid, 400, None, f"URL {url} was used. Supported endpoints: /v1/chat/completions, "
                                               "/v1/embeddings, /v1/audio/transcriptions, /v1/audio/translations, "
                                               "/score,  /rerank.")
        adapter = body.get("model") if body.get("model") in self.adapters else ""
        if body.get("model") not in self.names and not adapter:
            return output_line(cid, 404, None, _error(404, f"The model `{body.get('model')}` does not exist.",
                                                      "NotFoundError", "model"))
        if body.get("stream"):
            return output_line(cid, 400, None, "Request must not be sent in stream mode")
        if url == "/v1/embeddings":
            inputs = body.get("input") if isinstance(body.get("input"), list) else [body.get("input")]
            data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3, 0.4]} for i in range(len(inputs))]
            return output_line(cid, 200, {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                                          "model": body["model"], "data": data,
                                          "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}}, None)
        try:   # read as vllm serve reads them (max_completion_tokens first, none: the context left; over it: 400)
            prompt = self.vocab.prompt(body, True)
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"Input length ({len(prompt)}) exceeds model's maximum context length "
                                 f"({self.max_model_len}).")
            n, limit = choices_of(body), max_tokens_of(body, True, len(prompt), self.max_model_len)
            top = simlogprobs.asked(body, True, self.vocab.size)
            vocab = Adapted(self.vocab, adapter) if adapter else self.vocab
            made = [self._choice(vocab, prompt, limit, choice_body(body, j, n), body, j, top) for j in range(n)]
        except (ValueError, TypeError) as e:
            return output_line(cid, 400, None, _error(400, str(e), getattr(e, "etype", "BadRequestError"),
                                                      getattr(e, "param", None)))
        await asyncio.gather(*(self._decode(k) for _, k in made))   # (n choices: n engine requests)
        done = sum(k for _, k in made)
        return output_line(cid, 200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                      "created": int(time.time()), "model": adapter or self.names[0],
                                      "choices": [c for c, _ in made],
                                      "usage": {"prompt_tokens": len(prompt), "completion_tokens": done,
                                                "total_tokens": len(prompt) + done}}, None)

    def _choice(self, vocab, prompt: list[int], limit: int, sampling: dict, body: dict, index: int,
                top: int | None) -> tuple[dict, int]:
        """Choice ``index``'s answer, ended as vllm serve ends it (its logprobs when asked: ``top`` ranks), and its
        tokens (their decode time to wait); ``vocab``: the model's, or a LoRA adapter's view of it."""
        tokens, stops = vocab.generate(prompt, limit, sampling), Stops(body, self.vocab.eos)
        lp = None if top is None else simlogprobs.Logprobs(vocab, top, True)
        ids, seq, positions = [], list(prompt), []
        for tok in stops.upto(tokens, lambda t: self.vocab.piece(seq, t)):
            if lp:
                positions.append(lp.at(seq, tok))
            ids.append(tok)
            seq.append(tok)
        reason = "stop" if ids and (ids[-1] == self.vocab.eos or stops.reason is not None) else "length"
        return {"index": index, "message": {"role": "assistant", "content": stops.text if stops.active else
                                            self.vocab.text(ids)},
                "logprobs": lp.render(ids, positions) if lp else None, "finish_reason": reason,
                "stop_reason": stops.reason}, len(ids)

    async def _decode(self, tokens: int) -> None:
        async with self.slots:
            await asyncio.sleep(self.args.ttft_s + max(0, tokens - 1) / self.args.tokens_per_s)

    async def run(self) -> int:
        requests = []
        with open(self.args.input_file, encoding="utf-8") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    req = json.loads(raw)
                    if not (isinstance(req, dict) and isinstance(req.get("custom_id"), str) and isinstance(
                            req.get("url"), str) and isinstance(req.get("body"), dict)):
                        raise ValueError("not a batch request object")
                except ValueError as e:
                    print(f"simbatch: line {n} of {self.args.input_file}: {e}", file=sys.stderr)
                    return 1
                requests.append(req)
        tasks = [asyncio.ensure_future(self.answer(r)) for r in requests]
        total = len(tasks)
        with open(self.args.output_file, "w", encoding="utf-8") as out:
            for done, task in enumerate(tasks, 1):   # input order: line k waits for the lines before it
                out.write(json.dumps(await task, separators=(",", ":")) + "\n")
                out.flush()
                pct = 100 * done // max(1, total)
                print(f"Running batch: {pct:3d}% Completed | {done}/{total} [simbatch]", file=sys.stderr, flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return asyncio.run(SimBatch(args).run())


if __name__ == "__main__":
    sys.exit(main())
