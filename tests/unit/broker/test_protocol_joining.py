"""docs/protocol.md's statements about joining a run, checked against the code: the certificate text of
5.4 is pyzmq's, the claim-renewal script of 7.2 is the one the generators run, a msgpack extension type
(a timestamp) is `not_msgpack` as section 2 says, and section 12.2's list of what a producer's Redis user
may do is the generator's ACL (deploy/launcher/redis_acl.py)."""

import re

import msgpack
import pytest
import zmq.auth

from broker.protocol.codec import ProtocolError
from broker.protocol.group import decode_group, encode_group
from broker.protocol.keys import Keys
from broker.protocol.scripts import RENEW_CLAIMS
from deploy.launcher.redis_acl import rights
from tests.support.data import make_group
from tests.unit.broker.test_protocol_vectors import DOC

TEXT = DOC.read_text()


def section(number: str) -> str:
    start = TEXT.index(f"\n## {number}. ")
    nxt = re.search(r"\n## \d+\. ", TEXT[start + 1 :])
    return TEXT[start : start + 1 + nxt.start()] if nxt else TEXT[start:]


def dedent(block: str) -> str:
    return "\n".join(line[3:] if line.startswith("   ") else line for line in block.splitlines())


def test_the_certificate_text_of_5_4_is_what_pyzmq_writes(tmp_path):
    m = re.search(r"```\n(   #   \*\*\*\*  Generated on .*?)   ```", section("5"), re.S)
    assert m, "docs/protocol.md 5.4 lost the certificate's text"
    shown = dedent(m.group(1)).strip("\n").splitlines()
    _, secret = zmq.auth.create_certificates(str(tmp_path), "producer-0")
    real = open(secret).read().strip("\n").splitlines()
    assert len(shown) == len(real)
    for doc_line, line in zip(shown, real):  # the same lines but for the date and the keys
        pattern = re.escape(doc_line)
        pattern = re.sub(r"Generated\\ on\\ .*?\\ by", r"Generated\\ on\\ .*?\\ by", pattern)
        pattern = re.sub(r'"[^"]{40,}"', '"[^"]{40}"', re.sub(r'\\"(.*?)\\"', lambda k: '"' + "x" * 40 + '"', pattern))
        assert re.fullmatch(pattern, line), (doc_line, line)
    public, secret_key = zmq.auth.load_certificate(secret)
    keys = re.findall(r'(public|secret)-key = "(.{40})"', m.group(1))
    assert [k for k, _ in keys] == ["public", "secret"] and len(public) == len(secret_key) == 40


def test_the_claim_renewal_script_of_7_2_is_the_generators():
    m = re.search(r"\(`RENEW_CLAIMS` in\n   `broker/protocol/scripts.py`\):.*?```lua\n(.*?)   ```", section("7"), re.S)
    assert m, "docs/protocol.md 7.2 step 6 lost the renewal script"
    assert dedent(m.group(1)).strip() == RENEW_CLAIMS.strip()


def test_a_msgpack_timestamp_is_not_msgpack_as_section_2_says():
    fields = msgpack.unpackb(encode_group(make_group()), raw=False)
    fields["created_at"] = msgpack.Timestamp(1700000000, 0)
    with pytest.raises(ProtocolError) as e:
        decode_group(msgpack.packb(fields, use_bin_type=True))
    assert e.value.reason == "not_msgpack"
    assert "a msgpack timestamp (extension type -1) sent as `created_at`" in section("2")
    assert "bad_type" not in re.search(r"\*\*No extension types\.\*\*(.*?)\n- ", section("2"), re.S).group(1)


def test_section_12_2_lists_the_generators_redis_rights():
    table = re.search(r"### 12\.2 .*?\n\| commands \| keys.*?\n\n", TEXT, re.S).group(0)
    k = Keys("x")
    _, reads, grants = rights(k)["generator"]
    prefix = "relay:x:"
    for cmds, keys in grants:
        names = [c.lstrip("+").replace("|", " ").upper() for c in cmds]
        row = next(
            (
                line
                for line in table.splitlines()[2:]
                if {f"`{n}`" for n in names} <= set(line.split(" | ")[0].strip("| ").split(", "))
            ),
            None,
        )
        assert row, f"12.2 has no row for {names}"
        for key in keys:
            assert f"`{key.removeprefix(prefix).replace(chr(92), '')}`" in row, (key, row)
    read_row = next(line for line in table.splitlines() if "(read)" in line)
    for key in reads:
        assert f"`{key.removeprefix(prefix)}`" in read_row, key
