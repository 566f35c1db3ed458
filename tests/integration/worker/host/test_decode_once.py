"""Issue #14, item 10: an argument that fails to unpickle is unpickled once: its
``__reduce__`` side effects run once, and the call reports the decode's error."""

from __future__ import annotations

import pytest

from podium import errors
from tests.support.hostkit import hosted


class Unpicklable:
    """Unpickling it appends a line to ``path``, then raises."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        code = f"open({self.path!r}, 'a').write('decoded\\n'); raise ValueError('refused on purpose')"
        return (exec, (code,))


class Harmless:
    """Unpickling it appends a line to ``path`` and gives None (a payload that is not a call)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'a').write('decoded\\n')",))


@pytest.mark.parametrize("tcp_only", [False, True], ids=["same-host", "tcp"])
def test_a_failing_argument_is_decoded_once(token, arun, tmp_path, tcp_only):
    path = tmp_path / "decodes"

    async def scenario():
        async with hosted(token, tcp_only=tcp_only) as (host, client):
            with pytest.raises(errors.PodiumError) as info:
                await client.call("echo", (Unpicklable(str(path)),))
            assert "refused on purpose" in str(info.value)
            assert path.read_text() == "decoded\n"  # once, not twice
            assert await client.call("add", (2, 3)) == 5  # still serving
    arun(scenario())


def test_a_payload_that_decodes_to_none_is_decoded_once(token, arun, tmp_path):
    from podium.transport.payload import Payload
    from podium import codec

    path = tmp_path / "decodes"

    async def scenario():
        async with hosted(token) as (host, client):
            payload = Payload(codec.encode(Harmless(str(path))), reusable=False)
            with pytest.raises(errors.InvalidArgumentError, match=r"\(args, kwargs\)"):
                await client.call_encoded("echo", payload)
            assert path.read_text() == "decoded\n"
    arun(scenario())
