r"""Chat prompts: a conversation rendered by the model's Jinja chat template, then encoded.

A chat template comes with the checkpoint, so it is untrusted code: it runs in jinja2's
ImmutableSandboxedEnvironment, set up the way Hugging Face transformers sets up its own
(trim_blocks and lstrip_blocks, loop controls, `raise_exception(message)`, a `tojson` that
leaves non-ASCII and HTML characters alone, `strftime_now(format)`), with the variables
transformers passes that chat templates read: `messages` (a list of {role, content}),
`add_generation_prompt`, `bos_token` and `eos_token` (the vocabulary text of the model's
BOS id and of its first EOS id). The text is encoded without added special tokens, and
our tokenizers encode a special token written in text ("<|im_start|>") as its one id, so
the ids equal transformers' `apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)`.

End of turn. A chat model ends its answer with the token its template writes after each
assistant message (<|im_end|> for ChatML, <|eot_id|> for Llama 3, <end_of_turn> for
Gemma), which need not be one of the model's EOS ids. It is found once per template: the
template renders [user, assistant PROBE] without a generation prompt, and if the token
right after PROBE is a special one (it decodes to no text), it is the end-of-turn token.

    ...<|im_start|>assistant\nkvserve_probe<|im_end|>\n
                              ^ the probe  ^ the first token after it: special, so end of turn

A chat request stops there: the token goes into its stop_token_ids (unless ignore_eos,
which means "do not stop at the model's end tokens"), so it finishes with reason "stop"
(or "eos" where the token is an EOS id), and since decoding skips special tokens, its text
never reaches the output.

Nothing here imports torch: the router renders, and offline mode reuses it in-process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.errors import InvalidArgument
from workers.engine.sampling import SamplingParams
from workers.model.tokenizer import Tokenizer

__all__ = [
    "ROLES",
    "ChatMessage",
    "ChatPrompt",
    "ChatTemplate",
    "ChatTokenizer",
    "check_messages",
    "messages_from_json",
]

ROLES = ("system", "user", "assistant", "tool")
_PROBE = "kvserve_probe"  # a word no template rewrites (no spaces to trim, no markup)


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation; check_messages() validates a list of them."""

    role: str
    content: str


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the text the template made, and its ids."""

    text: str
    prompt_ids: tuple[int, ...]


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer that carries a chat template (workers.model.tokenizer.HFTokenizer)."""

    @property
    def chat_template(self) -> str | None:
        """The Jinja source, or None when the model has none."""
        ...

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary text of one id."""
        ...


def check_messages(messages: Sequence[ChatMessage], field: str) -> None:
    """Raise InvalidArgument naming `field` (or `field[i].role`) unless this is a
    conversation a template can be asked to render: at least one message, each of a known
    role. Empty content is allowed (an assistant turn may be empty)."""
    if not messages:
        raise InvalidArgument(field, "must hold at least one message")
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"{field}[{index}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}")


def messages_from_json(value: object, field: str) -> tuple[ChatMessage, ...]:
    """Messages given as JSON ([{"role": ..., "content": ...}, ...]), checked: each must be an
    object of exactly those two fields, both strings, then as check_messages()."""
    if not isinstance(value, list):
        raise InvalidArgument(field, "must be a list of {role, content} objects")
    messages = []
    for index, item in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(item, dict):
            raise InvalidArgument(where, "must be a {role, content} object")
        unknown = sorted(set(item) - {"role", "content"})
        if unknown:
            raise InvalidArgument(where, f"unknown fields {unknown}")
        for name in ("role", "content"):
            if not isinstance(item.get(name), str):
                raise InvalidArgument(f"{where}.{name}", "must be a string")
        messages.append(ChatMessage(item["role"], item["content"]))
    check_messages(messages, field)
    return tuple(messages)


class ChatTemplate:
    """A model's chat template, compiled once, with the tokenizer that encodes its output."""

    def __init__(self, source: str, tokenizer: ChatTokenizer) -> None:
        """Raises ValueError naming chat_template when the source does not compile."""
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat_template does not compile: {error}") from None
        self._tokenizer = tokenizer
        bos = tokenizer.bos_token_id
        eos = tokenizer.eos_token_ids
        self.bos_token = (tokenizer.token_text(bos) or "") if bos is not None else ""
        self.eos_token = (tokenizer.token_text(eos[0]) or "") if eos else ""
        self.end_of_turn_ids: tuple[int, ...] = _end_of_turn_ids(self, tokenizer)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The tokenizer's template, or None when it carries none (the byte tokenizer never
        does). Raises ValueError when it does not compile."""
        if not isinstance(tokenizer, ChatTokenizer) or not tokenizer.chat_template:
            return None
        return cls(tokenizer.chat_template, tokenizer)

    def render(self, messages: Sequence[ChatMessage], field: str, add_generation_prompt: bool = True) -> str:
        """The template's text for this conversation. A template that refuses it (its
        raise_exception, or any failure while rendering) raises InvalidArgument naming
        `field` with the template's message."""
        try:
            return self._template.render(
                messages=[_as_dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as error:
            raise InvalidArgument(field, f"the model's chat template refused it: {error.message or error}") from None
        except Exception as error:  # noqa: BLE001 - untrusted code: any failure is this conversation's
            raise InvalidArgument(
                field, f"the model's chat template failed on it: {type(error).__name__}: {error}"
            ) from None

    def encode(self, messages: Sequence[ChatMessage], field: str) -> ChatPrompt:
        """Check, render (with the generation prompt) and encode a conversation."""
        check_messages(messages, field)
        text = self.render(messages, field)
        return ChatPrompt(text, tuple(self._tokenizer.encode(text)))

    def stopping_at_end_of_turn(self, params: SamplingParams, vocab_size: int) -> SamplingParams:
        """`params` that also stop at the end-of-turn ids the engine does not already stop at
        as EOS, within the model's vocabulary; unchanged under ignore_eos."""
        if params.ignore_eos:
            return params
        eos = set(self._tokenizer.eos_token_ids)
        extra = tuple(
            t for t in self.end_of_turn_ids if t not in eos and t not in params.stop_token_ids and t < vocab_size
        )
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra) if extra else params


def _end_of_turn_ids(template: ChatTemplate, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The EOS ids, plus the special token the template writes after an assistant message."""
    eos = tuple(tokenizer.eos_token_ids)
    probe = [ChatMessage("user", "Hi"), ChatMessage("assistant", _PROBE)]
    try:
        text = template.render(probe, "chat_template", add_generation_prompt=False)
    except InvalidArgument:
        return eos  # the template refuses the probe: only EOS ends a turn
    at = text.rfind(_PROBE)
    if at < 0:
        return eos
    after = tokenizer.encode(text[at + len(_PROBE) :])
    if not after or after[0] in eos or tokenizer.decode(after[:1]) != "":
        return eos
    return (*eos, after[0])


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not get.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.datetime.now().strftime(format)


def _as_dict(message: ChatMessage) -> dict[str, str]:
    return {"role": message.role, "content": message.content}
