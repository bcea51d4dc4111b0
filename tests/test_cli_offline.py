"""`kvserve offline`: prompts as text, ids and JSONL; per-request sampling; JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.units import parse_bytes


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_offline_json_from_text_ids_and_a_requests_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "\n".join(
            [
                json.dumps({"request_id": "greedy", "prompt": "hello", "max_tokens": 5, "temperature": 0}),
                json.dumps({"prompt_ids": [1, 2, 3], "max_tokens": 7, "temperature": 0.8, "seed": 3, "logprobs": 2}),
                json.dumps({"prompt": "bad", "top_p": 2.0}),
                "",
            ]
        )
    )
    code = main(
        [
            "offline", "--model", "tiny", "--prompt", "The KV cache", "--prompt-ids", "72,105",
            "--requests", str(requests), "--max-tokens", "4", "--temperature", "0",
            "--kv-cache-memory", "8MiB", "--block-size", "8", "--json",
        ]
    )  # fmt: skip
    out = capsys.readouterr()
    rows = _json_lines(out.out)
    assert code == 1  # one request was bad; the rest ran
    assert [len(r["output_ids"]) for r in rows[:4]] == [4, 4, 5, 7]  # type: ignore[arg-type]
    assert rows[0]["prompt_ids"] == list(b"The KV cache")
    assert rows[1]["prompt_ids"] == [72, 105]
    assert rows[2]["request_id"] == "greedy"
    for row in rows[:4]:
        assert set(row) >= {"prompt_ids", "output_ids", "output_text", "finish_reason"}
        assert row["finish_reason"] == "length"
    assert len(rows[3]["logprobs"]) == 7  # type: ignore[arg-type]
    assert rows[4]["finish_reason"] == "error" and "top_p" in rows[4]["error"]  # type: ignore[operator]
    # The start-up report names the KV arithmetic: 8 MiB of 8-token blocks.
    assert "KV bytes per token: 2 x 8 layers x 2 kv heads x 64 head dim x 4 B = 8192 B" in out.err
    assert "128 blocks" in out.err


def test_offline_runs_all_prompts_in_one_batch_and_matches_single_runs(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["offline", "--model", "tiny", "--max-tokens", "6", "--temperature", "0", "--json"]
    main(base + ["--prompt", "one", "--prompt", "two"])
    together = [r["output_ids"] for r in _json_lines(capsys.readouterr().out)]
    main(base + ["--prompt", "two"])
    alone = [r["output_ids"] for r in _json_lines(capsys.readouterr().out)]
    assert together[1] == alone[0]


def test_offline_rejects_bad_flags_with_the_field_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["offline", "--model", "tiny", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["offline", "--model", "no-such-model", "--prompt", "x"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_parse_bytes() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1048576") == 2**20
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("12 parsecs")


def test_offline_messages_need_a_chat_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "\n".join(
            [
                json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                json.dumps({"messages": "hi"}),
                json.dumps({"prompt": "hi", "messages": []}),
                json.dumps({"prompt": "hi", "max_tokens": 2, "temperature": 0}),
            ]
        )
    )
    code = main(["offline", "--model", "tiny", "--requests", str(requests), "--kv-cache-memory", "8MiB", "--json"])
    rows = _json_lines(capsys.readouterr().out)
    assert code == 1
    errors = [str(r.get("error", "")) for r in rows]
    assert errors[0].startswith("messages: ") and "no chat template" in errors[0]  # the tiny preset has none
    assert errors[1].startswith("messages: ") and "list" in errors[1]
    assert errors[2].startswith("prompt: ") and "exactly one of prompt, prompt_ids, messages" in errors[2]
    assert rows[3]["finish_reason"] == "length"
    assert main(["offline", "--model", "tiny", "--prompt", "hi", "--chat"]) == 2
    assert "--chat: the model has no chat template" in capsys.readouterr().err


def test_offline_renders_messages_and_chat_prompts_with_the_routers_template(tmp_path: Path) -> None:
    """collect_prompts on a tokenizer with a template: the ids are transformers', and each
    stops at the end of turn."""
    from cluster.cli import build_parser
    from cluster.offline import collect_prompts
    from tests.hf_checkpoints import IM_END_ID, VOCAB_SIZE, write_chat_tokenizer
    from workers.engine.collect import PromptSpec
    from workers.model.chat_template_file import read_chat_template
    from workers.model.tokenizer import HFTokenizer

    reference = write_chat_tokenizer(tmp_path)
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json", 1, (2,), chat_template=read_chat_template(tmp_path))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🙂"}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"request_id": "c", "messages": conversation, "max_tokens": 3}) + "\n")
    args = build_parser().parse_args(
        ["offline", "--requests", str(requests), "--prompt", "Grüße 🙂", "--system", "Be brief."]
    )
    chat_prompt, from_file = collect_prompts(args, tokenizer, VOCAB_SIZE)
    (raw,) = collect_prompts(build_parser().parse_args(["offline", "--prompt", "raw"]), tokenizer, VOCAB_SIZE)
    assert isinstance(chat_prompt, PromptSpec) and isinstance(raw, PromptSpec) and isinstance(from_file, PromptSpec)
    expected = reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    expected = list(expected if isinstance(expected, list) else expected["input_ids"])
    assert list(from_file.prompt_ids) == list(chat_prompt.prompt_ids) == expected
    assert from_file.request_id == "c" and from_file.params.max_tokens == 3
    assert from_file.params.stop_token_ids == chat_prompt.params.stop_token_ids == (IM_END_ID,)
    assert list(raw.prompt_ids) == tokenizer.encode("raw") and raw.params.stop_token_ids == ()
