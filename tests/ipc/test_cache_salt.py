"""cache_salt from the SDK to the wire: refused in submit() when it is not a non-empty string of
at most 256 characters (nothing is sent, nothing is left open), carried when it is, and refused
by the decoder in a hostile frame."""

from __future__ import annotations

import msgpack
import pytest

from ipc.client.errors import BadRequestError
from ipc.codec import DecodeError, decode, encode, pack_ids, to_wire
from ipc.messages import RequestMeta, SamplingParams, SubmitRequest, TokenizedRequest
from tests.ipc.test_client_core import Handle, connected


def submit(core, **sampling_kwargs):
    return core.submit(
        Handle,
        None,
        None,
        prompt="hi",
        messages=None,
        prompt_token_ids=None,
        sampling=None,
        sampling_kwargs=sampling_kwargs,
        add_generation_prompt=True,
    )


@pytest.mark.parametrize("bad", [3, b"tenant", "", "x" * 257, "\ud800", ["a"]])
def test_submit_refuses_a_bad_cache_salt_and_sends_nothing(bad):
    core, pipes = connected(deadline_s=None)
    with pytest.raises(BadRequestError, match="cache_salt"):
        submit(core, cache_salt=bad, max_tokens=3)
    assert pipes.sent == [[]] and core.records == {}


def test_submit_carries_the_salt():
    core, pipes = connected(deadline_s=None)
    submit(core, cache_salt="tenant-a" * 32, max_tokens=3)
    submit(core, max_tokens=3)
    salted, plain = (decode(bytes(frame)) for frame in pipes.sent[0])
    assert isinstance(salted, SubmitRequest) and salted.cache_salt == "tenant-a" * 32
    assert plain.cache_salt is None


def test_a_hostile_frame_with_a_bad_salt_does_not_decode():
    request = TokenizedRequest(
        "r", pack_ids([1, 2]), SamplingParams(), RequestMeta("r", b"c", 2), cache_salt="ok"
    )
    assert decode(encode(request)).cache_salt == "ok"
    for bad in ("", "x" * 257, 7):
        wire = to_wire(request)
        wire["cache_salt"] = bad
        with pytest.raises(DecodeError, match="cache_salt"):
            decode(msgpack.packb(wire, use_bin_type=True))
