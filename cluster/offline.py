"""`kvserve offline`: run the engine in-process on a batch of prompts, like vLLM's offline mode."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.units import byte_size
from router.chat import ChatMessage, ChatTemplate, messages_from_json
from router.errors import InvalidArgument
from workers.config import ATTENTION_BACKENDS, LINEAR_BACKENDS, EngineArgs
from workers.engine.collect import PromptSpec, RequestOutput, run_to_completion
from workers.engine.errors import InvalidRequestError
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams
from workers.model.named_models import DEFAULT_MODEL, NAMED_MODELS
from workers.model.tokenizer import Tokenizer

_PROMPT_FORMS = ("prompt", "prompt_ids", "messages")
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a named model ({', '.join(NAMED_MODELS)}; default {DEFAULT_MODEL}), a .gguf file, "
                        "a Hugging Face checkpoint directory, or a random-weight preset (tiny, small, llama-3.2-1b, micro)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None, help="KV pool budget, e.g. 512MiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA only: the share of the device this worker may use; the KV pool gets what the "
                   "weights and a profiled step leave of it (default 0.9; an error on CPU)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: never torch.compile nor CUDA graphs")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt's KV instead of reusing cached blocks of earlier requests")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="decode attention: auto (FlashInfer on CUDA when installed, else SDPA), sdpa, flashinfer")
    g.add_argument("--linear-backend", choices=LINEAR_BACKENDS, default="auto",
                   help="projection matmuls: auto (for float32 on CPU: native where its kernel builds, else oneDNN; "
                        "else torch's), native (our AVX2 kernel for decode-sized calls, oneDNN above), onednn, aten")


def engine_args_from(args: argparse.Namespace, seed: int = 0) -> EngineArgs:
    """The EngineArgs that add_engine_arguments' flags describe."""
    return EngineArgs(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=seed,
        num_threads=args.num_threads,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
    )


def add_offline_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("offline", help="run the engine in-process on a batch of prompts")
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--chat", action="store_true",
                   help="send each --prompt as a user message through the model's chat template")
    p.add_argument("--system", default=None, help="with --chat (implied): a system message before each --prompt")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--requests", type=Path, help="a JSONL file, one request per line: prompt, prompt_ids or "
                   "messages (a list of {role, content}, rendered by the chat template), plus optional "
                   "request_id and sampling fields")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int, default=None, help="sampling seed for requests that give none")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--stop-token-ids", default="", help="comma-separated stop token ids")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="return the sampled token's logprob and N alternatives")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    p.set_defaults(func=run_offline)


def _parse_ids(text: str, field: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidRequestError(field, f"must be comma-separated integers, got {text!r}") from None


def _default_sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": tuple(args.stop),
        "stop_token_ids": _parse_ids(args.stop_token_ids, "stop_token_ids"),
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
    }


class _ChatPrompts:
    """Conversations as PromptSpecs, with router/chat.py's rendering and end-of-turn stop, so
    offline ids equal a router's. The template compiles on first use: most runs send none."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._template: ChatTemplate | None = None
        self._compiled = False

    def spec(
        self, messages: Sequence[ChatMessage], params: SamplingParams, field: str, request_id: str | None = None
    ) -> PromptSpec:
        """Raises InvalidArgument naming `field` (router/chat.py's errors, and "no template")."""
        if not self._compiled:
            self._template = ChatTemplate.of(self._tokenizer)  # ValueError when it does not compile
            self._compiled = True
        if self._template is None:
            raise InvalidArgument(field, "the model has no chat template")
        prompt = self._template.encode(messages, field)
        params = self._template.stopping_at_end_of_turn(params, self._vocab_size)
        return PromptSpec(prompt.prompt_ids, params, request_id)


def _request_from_json(
    line: str, where: str, defaults: dict[str, Any], tokenizer: Tokenizer, chat: _ChatPrompts
) -> PromptSpec:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("requests", f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("requests", f"{where}: each line must be a JSON object")
    forms = [name for name in _PROMPT_FORMS if name in obj]
    unknown = set(obj) - set(_SAMPLING_FIELDS) - set(_PROMPT_FORMS) - {"request_id"}
    if unknown:
        raise InvalidRequestError("requests", f"{where}: unknown fields {sorted(unknown)}")
    if len(forms) != 1:
        raise InvalidRequestError("prompt", f"{where}: give exactly one of {', '.join(_PROMPT_FORMS)}")
    sampling = dict(defaults)
    for name in _SAMPLING_FIELDS:
        if name in obj:
            value = obj[name]
            sampling[name] = tuple(value) if name in ("stop", "stop_token_ids") and isinstance(value, list) else value
    params = SamplingParams(**sampling)
    request_id = None if obj.get("request_id") is None else str(obj["request_id"])
    if "messages" in obj:
        try:
            return chat.spec(messages_from_json(obj["messages"], "messages"), params, "messages", request_id)
        except InvalidArgument as exc:
            raise InvalidRequestError(exc.field, f"{where}: {exc.detail}") from None
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise InvalidRequestError("prompt", f"{where}: must be a string")
        prompt_ids = tuple(tokenizer.encode(obj["prompt"]))
    else:
        if not isinstance(obj["prompt_ids"], list):
            raise InvalidRequestError("prompt_ids", f"{where}: must be a list of integers")
        prompt_ids = tuple(obj["prompt_ids"])
    return PromptSpec(prompt_ids, params, request_id)


def collect_prompts(
    args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int
) -> list[PromptSpec | RequestOutput]:
    """Every request of the call; a line that is already invalid becomes an error output.
    A --prompt with --chat or --system that the chat template refuses raises InvalidRequestError."""
    defaults = _default_sampling(args)
    params = SamplingParams(**defaults)
    chat = _ChatPrompts(tokenizer, vocab_size)
    specs: list[PromptSpec | RequestOutput] = []
    for text in args.prompt:
        if args.chat or args.system is not None:
            system = [] if args.system is None else [ChatMessage("system", args.system)]
            try:
                specs.append(chat.spec([*system, ChatMessage("user", text)], params, "--chat"))
            except InvalidArgument as exc:
                raise InvalidRequestError(exc.field, exc.detail) from None
        else:
            specs.append(PromptSpec(tuple(tokenizer.encode(text)), params))
    specs += [PromptSpec(_parse_ids(text, "prompt_ids"), params) for text in args.prompt_ids]
    if args.requests is not None:
        lines = args.requests.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{args.requests}:{number}"
            try:
                specs.append(_request_from_json(line, where, defaults, tokenizer, chat))
            except InvalidRequestError as exc:
                failed = RequestOutput(f"line-{number}", ())
                failed.finish_reason, failed.error = FinishReason.ERROR, str(exc)
                specs.append(failed)
    return specs


def _to_json(output: RequestOutput) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "request_id": output.request_id,
        "prompt_ids": list(output.prompt_ids),
        "output_ids": output.output_ids,
        "output_text": output.output_text,
        "finish_reason": output.finish_reason.value if output.finish_reason is not None else None,
    }
    if output.error is not None:
        obj["error"] = output.error
    if output.logprobs:
        obj["logprobs"] = [
            {"token_id": s.token_id, "logprob": s.logprob, "top": [[t.token_id, t.logprob] for t in s.top_logprobs]}
            for s in output.logprobs
        ]
    return obj


def run_offline(args: argparse.Namespace) -> int:
    from workers.model.build import create_engine, load  # torch loads only here

    engine_args = engine_args_from(args, seed=args.seed or 0)
    loaded = load(engine_args)
    specs = collect_prompts(args, loaded.tokenizer, loaded.config.vocab_size)
    if not specs:
        print("kvserve offline: give at least one --prompt, --prompt-ids or --requests", file=sys.stderr)
        return 2
    engine = create_engine(engine_args, loaded)
    runnable = [s for s in specs if isinstance(s, PromptSpec)]
    for index, spec in enumerate(runnable):
        if spec.request_id is None:
            runnable[index] = PromptSpec(spec.prompt_ids, spec.params, f"request-{index}")
    done = iter(run_to_completion(engine, runnable))
    outputs = [next(done) if isinstance(s, PromptSpec) else s for s in specs]
    _print_outputs(outputs, args.json, loaded.tokenizer.decode)
    return 0 if all(o.finish_reason is not FinishReason.ERROR for o in outputs) else 1


def _print_outputs(outputs: Sequence[RequestOutput], as_json: bool, decode: Any) -> None:
    for output in outputs:
        if as_json:
            print(json.dumps(_to_json(output)), flush=True)
            continue
        reason = output.finish_reason.value if output.finish_reason is not None else "?"
        print(f"=== {output.request_id}: {len(output.output_ids)} tokens, finish_reason={reason}")
        if output.error is not None:
            print(f"error: {output.error}")
            continue
        print(f"prompt: {decode(list(output.prompt_ids))!r}")
        print(f"output: {output.output_text!r}")
