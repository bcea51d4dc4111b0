"""Chat templates: our rendering gives transformers' apply_chat_template ids, the end-of-turn
token is found and stops generation without reaching the text, and bad conversations are
refused naming `messages`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from protos.kvserve.v1 import serving_pb2 as pb
from router.chat import ChatMessage, ChatTemplate, check_messages, messages_from_json
from router.errors import InvalidArgument
from router.validation import ClusterLimits, validate_generate
from tests.hf_checkpoints import CHATML_TEMPLATE, IM_END_ID, VOCAB_SIZE
from workers.engine.sampling import SamplingParams
from workers.model.chat_template_file import read_chat_template
from workers.model.config import ModelLoadError
from workers.model.tokenizer import ByteTokenizer, HFTokenizer, TokenizerSpec

BOS_ID, EOS_ID = 1, 2  # make_checkpoint's config

CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "user": [{"role": "user", "content": "Hello! How are you today?"}],
    "system + user": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is a paged attention block?"},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does the KV cache hold?"},
        {"role": "assistant", "content": "The keys and values of every token so far."},
        {"role": "user", "content": "And where does it live?"},
    ],
    "unicode": [{"role": "user", "content": "Grüße! café, naïve, système, 日本語 🙂 — «quotes»"}],
    "special token in content": [{"role": "user", "content": "say <|im_end|> then stop"}],
    "empty content": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
    "tool": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Calling the calculator."},
        {"role": "tool", "content": "4 <b>&</b>"},
    ],
}


def _messages(conversation: Sequence[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in conversation]


def _hf_ids(chat_reference: Any, conversation: Sequence[dict[str, str]]) -> list[int]:
    out = chat_reference.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.fixture(scope="module")
def tokenizer(chat_dir: Path) -> HFTokenizer:
    """Our tokenizer of the checkpoint, with the template as a loader would pass it."""
    return HFTokenizer(chat_dir / "tokenizer.json", BOS_ID, (EOS_ID,), chat_template=read_chat_template(chat_dir))


@pytest.fixture(scope="module")
def chat(tokenizer: HFTokenizer) -> ChatTemplate:
    template = ChatTemplate.of(tokenizer)
    assert template is not None
    return template


# -- reading a checkpoint's template ----------------------------------------------------


def test_a_checkpoint_saved_by_transformers_has_its_template_read(chat_dir: Path, chat_reference: Any) -> None:
    assert (chat_dir / "chat_template.jinja").is_file()
    assert read_chat_template(chat_dir) == chat_reference.chat_template == CHATML_TEMPLATE


def test_the_template_file_wins_then_tokenizer_config_as_a_string_or_the_default_of_a_list(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": "<s>"}))
    assert read_chat_template(tmp_path) is None
    config.write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert read_chat_template(tmp_path) == "{{ messages }}"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert read_chat_template(tmp_path) == "plain"
    config.write_text(json.dumps({"chat_template": named[:1]}))
    assert read_chat_template(tmp_path) is None  # only a tool_use template: none for a plain chat
    (tmp_path / "chat_template.jinja").write_text("from the file")
    assert read_chat_template(tmp_path) == "from the file"


@pytest.mark.parametrize(
    "content,words",
    [
        ("{not json", ["tokenizer_config.json", "JSON"]),
        (json.dumps({"chat_template": 3}), ["chat_template", "int"]),
        (json.dumps({"chat_template": [{"name": "default"}]}), ["chat_template", "default"]),
        (json.dumps({"chat_template": ["x"]}), ["chat_template", "name, template"]),
    ],
)
def test_an_unreadable_template_names_the_file(tmp_path: Path, content: str, words: list[str]) -> None:
    (tmp_path / "tokenizer_config.json").write_text(content)
    with pytest.raises(ModelLoadError) as info:
        read_chat_template(tmp_path)
    for word in words:
        assert word in str(info.value)


# -- rendering equals transformers ------------------------------------------------------


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rendered_ids_equal_apply_chat_template(chat: ChatTemplate, chat_reference: Any, name: str) -> None:
    conversation = CONVERSATIONS[name]
    prompt = chat.encode(_messages(conversation), "messages")
    assert prompt.text == chat_reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert list(prompt.prompt_ids) == _hf_ids(chat_reference, conversation)
    assert prompt.prompt_ids[0] == BOS_ID  # the template's {{ bos_token }}, one id
    assert prompt.text.endswith("<|im_start|>assistant\n")


def test_the_template_travels_with_the_tokenizer_spec(tokenizer: HFTokenizer, chat_reference: Any) -> None:
    rebuilt = TokenizerSpec.of(tokenizer).build()  # what a router on another node gets
    chat = ChatTemplate.of(rebuilt)
    assert chat is not None
    conversation = CONVERSATIONS["multi-turn"]
    assert list(chat.encode(_messages(conversation), "messages").prompt_ids) == _hf_ids(chat_reference, conversation)


def test_the_byte_tokenizer_has_no_template() -> None:
    assert ChatTemplate.of(ByteTokenizer()) is None
    assert ChatTemplate.of(TokenizerSpec.of(ByteTokenizer()).build()) is None


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2s_template_gives_transformers_ids(smollm2_tokenizer: Any, name: str) -> None:
    ours = HFTokenizer.from_tokenizers(
        smollm2_tokenizer.backend_tokenizer,
        smollm2_tokenizer.bos_token_id,
        (smollm2_tokenizer.eos_token_id,),
        smollm2_tokenizer.chat_template,
    )
    chat = ChatTemplate.of(ours)
    assert chat is not None
    conversation = CONVERSATIONS[name]
    expected = _hf_ids(smollm2_tokenizer, conversation)
    assert list(chat.encode(_messages(conversation), "messages").prompt_ids) == expected
    # Its <|im_end|> is its EOS: the end of turn adds nothing, and the engine stops there as EOS.
    assert smollm2_tokenizer.convert_ids_to_tokens(smollm2_tokenizer.eos_token_id) == "<|im_end|>"
    assert chat.end_of_turn_ids == (smollm2_tokenizer.eos_token_id,)
    assert chat.stopping_at_end_of_turn(SamplingParams(), VOCAB_SIZE).stop_token_ids == ()


# -- the end of turn --------------------------------------------------------------------


def test_the_end_of_turn_is_eos_plus_the_special_token_after_an_assistant_message(chat: ChatTemplate) -> None:
    assert chat.end_of_turn_ids == (EOS_ID, IM_END_ID)
    assert chat.bos_token == "<s>" and chat.eos_token == "</s>"
    params = chat.stopping_at_end_of_turn(SamplingParams(stop_token_ids=(7,)), VOCAB_SIZE)
    assert params.stop_token_ids == (7, IM_END_ID)  # EOS is left to the engine's EOS check
    assert chat.stopping_at_end_of_turn(params, VOCAB_SIZE) == params  # no duplicates
    assert chat.stopping_at_end_of_turn(SamplingParams(ignore_eos=True), VOCAB_SIZE).stop_token_ids == ()
    assert chat.stopping_at_end_of_turn(SamplingParams(), IM_END_ID).stop_token_ids == ()  # outside the model


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",  # no special token at all
        "{% for m in messages %}{{ m['content'] }} <|im_end|>{% endfor %}",  # a space comes first
        "{{ raise_exception('no assistant turns here') }}",  # refuses the probe
    ],
)
def test_a_template_without_a_special_token_after_the_answer_ends_at_eos(tokenizer: HFTokenizer, template: str) -> None:
    chat = ChatTemplate(template, _with_template(tokenizer, template))
    assert chat.end_of_turn_ids == (EOS_ID,)


def _with_template(tokenizer: HFTokenizer, template: str) -> HFTokenizer:
    return HFTokenizer.from_json_str(tokenizer.to_json_str(), BOS_ID, (EOS_ID,), template)


def test_generation_stops_at_the_end_of_turn_and_its_text_is_not_output(chat_dir: Path, chat: ChatTemplate) -> None:
    """The model says <|im_end|> as its 5th token: the request finishes with reason stop there,
    the token is its last output id, and the text has no <|im_end|>."""
    from workers.engine.collect import PromptSpec, run_to_completion
    from workers.engine.request import FinishReason
    from workers.model.build import EngineArgs, create_engine, load

    args = EngineArgs(model=str(chat_dir), device="cpu", kv_cache_memory=2**20, num_threads=1)
    loaded = load(args)
    prompt = chat.encode(_messages(CONVERSATIONS["system + user"]), "messages").prompt_ids
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    plain = create_engine(args, loaded, quiet=True)
    (free,) = run_to_completion(plain, [PromptSpec(prompt, greedy)])
    assert IM_END_ID not in free.output_ids[:4]

    engine = create_engine(args, loaded, quiet=True)
    engine.runner = _SaysAt(engine.runner, IM_END_ID, at=4)
    (stopped,) = run_to_completion(engine, [PromptSpec(prompt, chat.stopping_at_end_of_turn(greedy, VOCAB_SIZE))])
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids == [*free.output_ids[:4], IM_END_ID]
    assert "<|im_end|>" not in stopped.output_text and "im_end" not in stopped.output_text
    assert stopped.output_text == loaded.tokenizer.decode(free.output_ids[:4])

    # Under ignore_eos nothing is added, and the token is still not text.
    ignoring = create_engine(args, loaded, quiet=True)
    ignoring.runner = _SaysAt(ignoring.runner, IM_END_ID, at=4)
    params = chat.stopping_at_end_of_turn(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), VOCAB_SIZE)
    (ran_on,) = run_to_completion(ignoring, [PromptSpec(prompt, params)])
    assert ran_on.finish_reason is FinishReason.LENGTH and ran_on.output_ids[4] == IM_END_ID
    assert "<|im_end|>" not in ran_on.output_text


class _SaysAt:
    """The model, except that its output number `at` (0-based) is `token_id`: a chat model
    ending its turn, which a random-weight model would not do when asked."""

    def __init__(self, inner: Any, token_id: int, at: int) -> None:
        self.inner = inner
        self.token_id = token_id
        self.at = at
        self.num_sampled: dict[str, int] = {}

    def execute(self, plan: Any) -> Any:
        from workers.engine.plan import SampledToken

        sampled = dict(self.inner.execute(plan))
        for request_id in sampled:
            index = self.num_sampled.get(request_id, 0)
            self.num_sampled[request_id] = index + 1
            if index == self.at:
                sampled[request_id] = SampledToken(self.token_id)
        return sampled


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conversation,field,words",
    [
        ([], "messages", ["at least one"]),
        (
            [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
            "messages[1].role",
            ["robot", "user"],
        ),
        ([{"role": "", "content": "hi"}], "messages[0].role", ["system, user, assistant, tool"]),
        ([{"role": "tool", "content": "4"}], "messages", ["a conversation cannot start with a tool message"]),
    ],
)
def test_a_bad_conversation_is_refused_naming_messages(
    chat: ChatTemplate, conversation: list[dict[str, str]], field: str, words: list[str]
) -> None:
    with pytest.raises(InvalidArgument) as info:
        chat.encode(_messages(conversation), "messages")
    assert info.value.field == field
    for word in [field, *words]:
        assert word in str(info.value)


def test_a_failing_or_unsafe_template_is_the_conversations_error(tokenizer: HFTokenizer) -> None:
    for template, words in [
        ("{{ messages[0]['content'] + 1 }}", ["TypeError"]),
        ("{{ messages[5]['content'] }}", ["refused"]),  # undefined, then its attribute
        ("{{ messages.append({'role': 'x'}) }}", ["refused", "unsafe"]),  # the sandbox is immutable
        ("{{ ''.__class__.__mro__ }}", ["refused"]),
    ]:
        chat = ChatTemplate(template, _with_template(tokenizer, template))
        with pytest.raises(InvalidArgument) as info:
            chat.encode([ChatMessage("user", "hi")], "prompt.messages")
        assert info.value.field == "prompt.messages"
        for word in words:
            assert word in str(info.value), (template, str(info.value))


def test_a_template_that_does_not_compile_names_chat_template(tokenizer: HFTokenizer) -> None:
    with pytest.raises(ValueError, match="chat_template does not compile"):
        ChatTemplate.of(_with_template(tokenizer, "{% for m in messages %}"))


def test_strftime_now_and_tojson_are_there_for_templates(tokenizer: HFTokenizer) -> None:
    template = "{{ strftime_now('%Y') }}|{{ {'a': 'é<'} | tojson }}|{{ messages | length }}"
    chat = ChatTemplate(template, _with_template(tokenizer, template))
    year, as_json, count = chat.render([ChatMessage("user", "hi")], "messages").split("|")
    assert len(year) == 4 and year.isdigit()
    assert as_json == '{"a": "é<"}' and count == "1"


def test_messages_from_json_checks_every_element() -> None:
    assert messages_from_json([{"role": "user", "content": "hi"}], "messages") == (ChatMessage("user", "hi"),)
    for value, field in [
        ("hi", "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": "x", "name": "bob"}], "messages[0]"),
        ([{"role": "user", "content": "x"}, {"role": "narrator", "content": "x"}], "messages[1].role"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            messages_from_json(value, "messages")
        assert info.value.field == field, value
    check_messages([ChatMessage("assistant", "")], "messages")  # empty content is fine


# -- the API boundary -------------------------------------------------------------------

LIMITS = ClusterLimits(vocab_size=VOCAB_SIZE, max_model_len=512, block_size=16, max_worker_blocks=64)


def _chat_request(conversation: Sequence[dict[str, str]], **sampling: Any) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=messages), sampling=pb.SamplingParams(**sampling))


def test_validate_generate_renders_messages_and_stops_at_the_end_of_turn(
    tokenizer: HFTokenizer, chat: ChatTemplate, chat_reference: Any
) -> None:
    conversation = CONVERSATIONS["multi-turn"]
    valid = validate_generate(_chat_request(conversation, max_tokens=8), LIMITS, tokenizer, chat)
    assert list(valid.prompt_ids) == _hf_ids(chat_reference, conversation)
    assert valid.prompt_text == chat_reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert valid.params.stop_token_ids == (IM_END_ID,)
    # Text stays text: no template, no end-of-turn stop; its text is kept too.
    text = validate_generate(pb.GenerateRequest(text="<|im_start|>user"), LIMITS, tokenizer, chat)
    assert text.prompt_ids == (3, *tokenizer.encode("user")) and text.prompt_text == "<|im_start|>user"
    assert text.params.stop_token_ids == ()
    ids = validate_generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), LIMITS, tokenizer, chat)
    assert ids.prompt_text == ""


@pytest.mark.parametrize(
    "request_,has_template,field,words",
    [
        (_chat_request(CONVERSATIONS["user"]), False, "prompt.messages", ["no chat template"]),
        (_chat_request([]), True, "prompt.messages", ["at least one"]),
        (_chat_request([]), False, "prompt.messages", ["at least one"]),
        (_chat_request([{"role": "bot", "content": "x"}]), False, "prompt.messages[0].role", ["bot"]),
        (_chat_request([{"role": "tool", "content": "x"}]), True, "prompt.messages", ["tool message"]),
        (_chat_request([{"role": "user", "content": "x" * 600}]), True, "prompt.messages", ["exceed the limit"]),
    ],
)
def test_validate_generate_refuses_bad_messages_naming_them(
    tokenizer: HFTokenizer, chat: ChatTemplate, request_: pb.GenerateRequest, has_template: bool, field: str,
    words: list[str],
) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_generate(request_, LIMITS, tokenizer, chat if has_template else None)
    assert info.value.field == field
    for word in [field, *words]:
        assert word in str(info.value)



def test_bad_utf8_in_a_message_is_named_by_its_index() -> None:
    from router.validation import decode_request

    request = _chat_request([{"role": "user", "content": "fine"}, {"role": "user", "content": "XX"}])
    raw = request.SerializeToString().replace(b"XX", b"\xff\xfe")
    with pytest.raises(InvalidArgument) as info:
        decode_request(pb.GenerateRequest, raw)
    assert info.value.field == "prompt.messages[1].content"
