"""Incremental detokenization: whole characters only, and stop strings never leak."""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.detokenizer import IncrementalDetokenizer


class Bytes:
    """Token i is byte i, as in the byte-level presets."""

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stop: Sequence[str] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(Bytes(), list(b"prompt: "), stop)
    deltas = []
    data = text.encode()
    for i, byte in enumerate(data):
        detokenizer.push(byte)
        final = i == len(data) - 1 or detokenizer.stopped
        if final:
            detokenizer.finish()
        deltas.append(detokenizer.take_delta(final=final))
        if detokenizer.stopped:
            break
    return deltas, detokenizer


def test_multibyte_characters_are_emitted_whole() -> None:
    deltas, _ = _stream("añ€😀")
    assert "".join(deltas) == "añ€😀"
    assert all("\ufffd" not in d for d in deltas)
    # '€' is three bytes: nothing comes out until its last byte arrives.
    assert deltas[3:6] == ["", "", "€"]


def test_stop_string_spanning_tokens_is_cut_and_never_emitted() -> None:
    deltas, detokenizer = _stream("hello STOP world", stop=("STOP",))
    assert detokenizer.stopped
    assert "".join(deltas) == "hello "
    assert detokenizer.text == "hello "


def test_earliest_of_several_stop_strings_wins() -> None:
    _, detokenizer = _stream("abcdef", stop=("def", "cd"))
    assert detokenizer.text == "ab"


def test_text_that_only_looks_like_a_stop_prefix_is_released() -> None:
    deltas, detokenizer = _stream("ST then more", stop=("STOP",))
    assert not detokenizer.stopped
    assert "".join(deltas) == "ST then more"
    # While streaming, up to len("STOP") - 1 characters are held back.
    assert deltas[1] == ""


def test_incomplete_character_at_the_end_is_flushed_as_replacement() -> None:
    detokenizer = IncrementalDetokenizer(Bytes(), [])
    for byte in "x€".encode()[:-1]:
        detokenizer.push(byte)
    detokenizer.finish()
    assert detokenizer.take_delta(final=True) == "x\ufffd"
