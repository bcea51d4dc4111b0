"""The API boundary: a GenerateRequest becomes a validated request, or INVALID_ARGUMENT naming
the field. Nothing here touches placement, Redis or KV: a bad request costs nothing."""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from protos.kvserve.v1 import serving_pb2 as pb
from router.errors import InvalidArgument
from workers.engine.config import blocks_for_tokens
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling import SamplingParams
from workers.model.tokenizer import Tokenizer

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass(frozen=True)
class ModelLimits:
    """What every worker of the cluster agrees on (they serve one model)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    max_worker_blocks: int  # the largest worker's pool
    max_prompt_tokens: int | None = None  # an operator limit below max_model_len
    max_tokens_limit: int | None = None


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    need_blocks: int  # KV blocks at its longest: prompt plus max_tokens, minus the last token


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def validate_request_id(request_id: str, field: str = "request_id") -> str:
    if not _REQUEST_ID.match(request_id):
        raise InvalidArgument(field, "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return request_id


def validate_generate(message: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer) -> ValidRequest:
    """Check every field; the first bad one raises InvalidArgument naming it."""
    request_id = validate_request_id(message.request_id) if message.request_id else new_request_id()
    prompt_ids = _prompt_ids(message, limits, tokenizer)
    params = _sampling(message.sampling if message.HasField("sampling") else pb.SamplingParams(), limits)
    if len(prompt_ids) + params.max_tokens > limits.max_model_len:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
            f"the model's max length {limits.max_model_len}",
        )
    need = blocks_for_tokens(len(prompt_ids) + params.max_tokens - 1, limits.block_size)
    if need > limits.max_worker_blocks:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"prompt plus max_tokens needs {need} KV blocks; the largest worker holds {limits.max_worker_blocks}",
        )
    return ValidRequest(request_id, prompt_ids, params, need)


def _prompt_ids(message: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer) -> tuple[int, ...]:
    which = message.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt", "set one of prompt.text or prompt.token_ids")
    if which == "text":
        if not message.text:
            raise InvalidArgument("prompt.text", "must not be empty")
        ids = tuple(tokenizer.encode(message.text))
        field = "prompt.text"
        if not ids:
            raise InvalidArgument(field, "encodes to no tokens")
    else:
        ids = tuple(message.token_ids.ids)
        field = "prompt.token_ids"
        if not ids:
            raise InvalidArgument(field, "must not be empty")
        for index, token_id in enumerate(ids):
            if not 0 <= token_id < limits.vocab_size:
                raise InvalidArgument(
                    field, f"token id {token_id} at index {index} is outside the vocabulary [0, {limits.vocab_size})"
                )
    max_prompt = min(limits.max_model_len - 1, limits.max_prompt_tokens or limits.max_model_len)
    if len(ids) > max_prompt:
        raise InvalidArgument(field, f"{len(ids)} tokens exceed the limit of {max_prompt}")
    return ids


def _sampling(s: pb.SamplingParams, limits: ModelLimits) -> SamplingParams:
    stop = tuple(s.stop)
    if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_LENGTH for x in stop):
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} strings of {MAX_STOP_LENGTH} characters")
    for token_id in s.stop_token_ids:
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidArgument(
                "sampling.stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {limits.vocab_size})"
            )
    for name in ("temperature", "top_p"):
        if s.HasField(name) and math.isnan(getattr(s, name)):
            raise InvalidArgument(f"sampling.{name}", "must be a number, got NaN")
    max_tokens = s.max_tokens if s.HasField("max_tokens") else 16
    if limits.max_tokens_limit is not None and max_tokens > limits.max_tokens_limit:
        raise InvalidArgument("sampling.max_tokens", f"must be at most {limits.max_tokens_limit}, got {max_tokens}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else 0,
            seed=s.seed if s.HasField("seed") else None,
            stop=stop,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
        )
    except InvalidRequestError as exc:
        raise InvalidArgument(f"sampling.{exc.field}", exc.detail) from None


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The inverse, for GetRequest."""
    out = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        out.seed = params.seed
    if params.logprobs is not None:
        out.logprobs = params.logprobs
    return out
