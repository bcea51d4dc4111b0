"""The API boundary: a GenerateRequest becomes a validated request, or INVALID_ARGUMENT naming
the field. Nothing here touches placement, Redis or KV: a bad request costs nothing."""

from __future__ import annotations

import functools
import math
import re
import uuid
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

from protos.kvserve.v1 import serving_pb2 as pb
from router.chat import ChatMessage, ChatTemplate, check_messages
from router.errors import InvalidArgument
from workers.engine.block_hash import BlockHash, hash_blocks, request_extra_keys
from workers.engine.config import blocks_for_tokens
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling import SamplingParams
from workers.model.tokenizer import Tokenizer

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_CACHE_SALT_LENGTH = 256
M = TypeVar("M", bound=Message)
_CHAT_WRAPPER_PATH = "prompt.messages.messages["  # GenerateRequest.messages (ChatMessages).messages[i]


@dataclass(frozen=True)
class ClusterLimits:
    """What the router admits against: the limits every worker agrees on (they serve one
    model), the largest worker's pool, and the operator's caps. The engine's own
    workers.engine.engine.ModelLimits is what one engine validates with."""

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
    prompt_text: str = ""  # what prompt_ids were encoded from: the text, or the rendered chat
    block_hashes: tuple[BlockHash, ...] = ()  # the prompt's full blocks, as a worker's prefix cache names them
    cache_salt: str | None = None  # shares cached KV only with requests of the same salt


class _Prompt(NamedTuple):
    ids: tuple[int, ...]
    text: str  # "" for token ids


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def validate_request_id(request_id: str, field: str = "request_id") -> str:
    # fullmatch: with match, the pattern's `$` would also accept the id followed by a newline.
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument(field, "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return request_id


def validate_generate(
    message: pb.GenerateRequest, limits: ClusterLimits, tokenizer: Tokenizer, chat: ChatTemplate | None = None
) -> ValidRequest:
    """Check every field; the first bad one raises InvalidArgument naming it. `chat` is the
    model's chat template (None: it has none), for prompt.messages; a chat request also stops
    at the template's end-of-turn token (router/chat.py)."""
    request_id = validate_request_id(message.request_id) if message.request_id else new_request_id()
    cache_salt = _cache_salt(message)
    prompt = _prompt(message, limits, tokenizer, chat)
    prompt_ids = prompt.ids
    params = _sampling(message.sampling if message.HasField("sampling") else pb.SamplingParams(), limits)
    if chat is not None and message.WhichOneof("prompt") == "messages":
        params = chat.stopping_at_end_of_turn(params, limits.vocab_size)
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
    return ValidRequest(request_id, prompt_ids, params, need, prompt.text,
                        prompt_block_hashes(prompt_ids, limits.block_size, cache_salt), cache_salt)


def prompt_block_hashes(
    prompt_ids: tuple[int, ...], block_size: int, cache_salt: str | None = None
) -> tuple[BlockHash, ...]:
    """The hashes of the prompt blocks a worker's prefix cache can serve, under the
    request's cache salt: the full blocks before its last token, which is always computed
    for its logits."""
    return tuple(hash_blocks(prompt_ids[:-1], block_size, request_extra_keys(cache_salt)))


def _cache_salt(message: pb.GenerateRequest) -> str | None:
    if not message.HasField("cache_salt"):
        return None
    salt = message.cache_salt
    if not salt:
        raise InvalidArgument("cache_salt", "must not be empty when set (leave it unset for no salt)")
    if len(salt) > MAX_CACHE_SALT_LENGTH:
        # Its length only: the value is a tenant's secret.
        raise InvalidArgument("cache_salt", f"must be at most {MAX_CACHE_SALT_LENGTH} characters, got {len(salt)}")
    return salt


def _prompt(
    message: pb.GenerateRequest, limits: ClusterLimits, tokenizer: Tokenizer, chat: ChatTemplate | None
) -> _Prompt:
    which = message.WhichOneof("prompt")
    text = ""
    if which is None:
        raise InvalidArgument("prompt", "set one of prompt.text, prompt.token_ids or prompt.messages")
    if which == "text":
        if not message.text:
            raise InvalidArgument("prompt.text", "must not be empty")
        text = message.text
        ids = tuple(tokenizer.encode(text))
        field = "prompt.text"
        if not ids:
            raise InvalidArgument(field, "encodes to no tokens")
    elif which == "messages":
        # Named without the ChatMessages wrapper: prompt.messages[i].role, not prompt.messages.messages[i].
        field = "prompt.messages"
        messages = [ChatMessage(m.role, m.content) for m in message.messages.messages]
        check_messages(messages, field)  # before the template: a bad list is bad for any model
        if chat is None:
            raise InvalidArgument(field, "the model has no chat template; send prompt.text or prompt.token_ids")
        rendered = chat.encode(messages, field)
        text, ids = rendered.text, rendered.prompt_ids
        if not ids:
            raise InvalidArgument(field, "the chat template renders them to no tokens")
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
    return _Prompt(ids, text)


def _sampling(s: pb.SamplingParams, limits: ClusterLimits) -> SamplingParams:
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


def decode_request(message_type: type[M], raw: bytes) -> M:
    """Parse a request message. Bytes that are not one, or a string field that is not
    UTF-8, raise InvalidArgument naming that field (protobuf's own error names none, and
    gRPC would answer UNKNOWN)."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        pass
    twin, string_fields = _bytes_twin(message_type.DESCRIPTOR)
    try:
        parsed = twin.FromString(raw)
    except DecodeError:
        raise InvalidArgument("request", f"is not a {message_type.DESCRIPTOR.full_name} message") from None
    field = _first_bad_utf8(parsed, string_fields, "")
    if field is not None:  # named as _prompt names it, without the ChatMessages wrapper
        field = field.replace(_CHAT_WRAPPER_PATH, "prompt.messages[", 1)
    raise InvalidArgument(field or "request", "is not valid UTF-8")


@functools.cache
def _bytes_twin(descriptor: Descriptor) -> tuple[type[Message], frozenset[str]]:
    """The message type with every string field made bytes (in a pool of its own), so that a
    request with bad UTF-8 still parses and the field can be found; and those fields' names."""
    pool = descriptor_pool.DescriptorPool()
    string_fields: set[str] = set()

    def add(file: FileDescriptor) -> None:
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for message in proto.message_type:
            _strings_to_bytes(message, f"{proto.package}.", string_fields)
        pool.Add(proto)

    add(descriptor.file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(descriptor.full_name)), frozenset(string_fields)


def _strings_to_bytes(message: descriptor_pb2.DescriptorProto, scope: str, names: set[str]) -> None:
    for field in message.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            names.add(f"{scope}{message.name}.{field.name}")
    for nested in message.nested_type:
        _strings_to_bytes(nested, f"{scope}{message.name}.", names)


def _first_bad_utf8(message: Message, string_fields: frozenset[str], prefix: str) -> str | None:
    """The API name of the first string field (depth first) that is not UTF-8: a oneof
    member is named through its oneof ('prompt.text'), a nested one through its parent, an
    element of a repeated message field by its index ('x.items[2].name')."""
    for field, value in message.ListFields():
        oneof = field.containing_oneof
        name = f"{prefix}{oneof.name}.{field.name}" if oneof is not None and not oneof.name.startswith("_") else (
            f"{prefix}{field.name}"
        )
        values = [value] if isinstance(value, (bytes, Message)) else value  # else a repeated field
        if field.full_name in string_fields:
            for raw in values:
                assert isinstance(raw, bytes), field.full_name  # the descriptor made it a bytes field
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            repeated = not isinstance(value, Message)
            for index, nested in enumerate(values):
                found = _first_bad_utf8(nested, string_fields, f"{name}[{index}]." if repeated else f"{name}.")
                if found is not None:
                    return found
    return None


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
