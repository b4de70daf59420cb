"""OpenAI's logprobs bodies from LogprobEntry lists: completions (with echo and text offsets
across stream chunks), chat, vLLM's prompt_logprobs."""

from __future__ import annotations

from http_worker.answer_format import ChoiceOutput
from http_worker.completions_bodies import ChatFormat, CompletionFormat
from http_worker.logprobs import TextOffsets, chat_logprobs, prompt_logprobs_body
from ipc.messages import LogprobEntry, TopLogprob


def entry(token_id: int, data: bytes, logprob: float | None, *top: tuple[int, bytes, float]):
    return LogprobEntry(
        token_id,
        data.decode(errors="replace"),
        logprob,
        data,
        [TopLogprob(i, b.decode(errors="replace"), lp, b) for i, b, lp in top],
    )


# " ✓" split across three byte-level tokens, then " ok".
CHECK = [
    entry(1, b" \xe2", -1.0, (1, b" \xe2", -1.0)),
    entry(2, b"\x9c", -2.0),
    entry(3, b"\x93", -3.0),
    entry(4, b" ok", -4.0, (5, b" no", -0.5), (4, b" ok", -4.0)),
]


def test_text_offsets_point_at_the_character_a_token_belongs_to():
    offsets = TextOffsets()
    assert [offsets.next(e.bytes) for e in CHECK] == [0, 1, 1, 2]
    offsets.jump(10)
    assert offsets.next(b"x") == 10 and offsets.next(b"y") == 11


def test_completion_logprobs_with_echo_and_a_stream_split_in_chunks():
    prompt = [entry(7, b"Say", None), entry(8, b":", -0.7, (9, b"!", -0.1))]
    fmt = CompletionFormat("m", logprobs=1, echo=True)
    first = fmt.chunk(0, ChoiceOutput(" \u2713"[:1], None, CHECK[:2], prompt, "Say:"))
    choice = first["choices"][0]
    assert choice["text"] == "Say: "
    body = choice["logprobs"]
    assert body["tokens"] == ["Say", ":", " \ufffd", "\ufffd"]
    assert body["token_logprobs"] == [None, -0.7, -1.0, -2.0]
    assert body["top_logprobs"] == [
        None,
        {"!": -0.1, ":": -0.7},
        {" \ufffd": -1.0},
        {"\ufffd": -2.0},
    ]
    assert body["text_offset"] == [0, 3, 4, 5]  # the output starts where "Say:" ends
    rest = fmt.chunk(0, ChoiceOutput("\u2713 ok", "length", CHECK[2:]))["choices"][0]
    assert rest["logprobs"]["text_offset"] == [5, 6] and rest["finish_reason"] == "length"
    assert rest["logprobs"]["top_logprobs"] == [{"\ufffd": -3.0}, {" no": -0.5, " ok": -4.0}]
    plain = CompletionFormat("m").full([ChoiceOutput("x", "stop", CHECK)], {})
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_show_bytes_and_the_top_n():
    body = chat_logprobs(CHECK[3:], 1)
    assert body == {
        "content": [
            {
                "token": " ok",
                "logprob": -4.0,
                "bytes": [32, 111, 107],
                "top_logprobs": [{"token": " no", "logprob": -0.5, "bytes": [32, 110, 111]}],
            }
        ]
    }
    full = ChatFormat("m", logprobs=0).full([ChoiceOutput(" ok", "stop", CHECK[3:])], {})
    assert full["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert "prompt_logprobs" not in full


def test_vllm_prompt_logprobs_shape():
    prompt = [entry(7, b"Say", None), entry(8, b":", -0.7, (9, b"!", -0.1), (8, b":", -0.7))]
    assert prompt_logprobs_body(prompt) == [
        None,
        {
            "8": {"logprob": -0.7, "rank": 2, "decoded_token": ":"},
            "9": {"logprob": -0.1, "rank": 1, "decoded_token": "!"},
        },
    ]
    full = ChatFormat("m", prompt_logprobs=True).full([ChoiceOutput("x", "stop", [], prompt)], {})
    assert full["prompt_logprobs"][0] is None and "8" in full["prompt_logprobs"][1]
