"""Announcement signatures (broker/protocol/signing.py): what the key covers, as docs/protocol.md states it."""

import os
import stat

import pytest

from broker.protocol import signing
from broker.protocol.messages import Announcement, decode_announcement, encode_announcement

KEY = bytes(range(32))
A = Announcement(version=7, hash="ab" * 32, path="/store/v000007", url="", published_at=1700000000.25)


def test_canonical_bytes_and_signature_match_the_documented_example():
    # the example of docs/protocol.md ("Announcement signature"): a producer in another language reproduces it
    assert signing.canonical_bytes("run1", A) == (
        b"17:relay-announce-v1,1:1,4:run1,1:7,64:" + b"ab" * 32 + b",14:/store/v000007,0:,17:1700000000.250000,")
    # key = bytes 0x00..0x1f
    assert signing.signature(KEY, "run1", A) == "adcb90f3bb57f6a041065da7b53e698f72ab487168137b720baa1f5bfc2ac2d0"


def test_every_field_and_the_run_are_covered():
    a = signing.signed(KEY, "run1", Announcement(**{**A.__dict__}))
    assert signing.check(KEY, "run1", a) is None
    # the signature survives the wire
    assert signing.check(KEY, "run1", decode_announcement(encode_announcement(a))) is None
    for change in ({"version": 8}, {"hash": "cd" * 32}, {"path": "/attacker/v000007"}, {"url": "http://evil"},
                   {"published_at": 1700000000.5}):
        forged = Announcement(**{**a.__dict__, **change})
        assert signing.check(KEY, "run1", forged) == "bad_signature", change
    assert signing.check(KEY, "run2", a) == "bad_signature"  # replayed into another run
    assert signing.check(bytes(32), "run1", a) == "bad_signature"  # signed with another key
    assert signing.check(KEY, "run1", Announcement(**{**a.__dict__, "sig": ""})) == "unsigned"


def test_the_tensor_digest_is_signed_as_a_ninth_netstring_and_cannot_be_swapped_or_stripped():
    """docs/protocol.md 6.1.1: with a digest, its netstring follows the eight values; without one the
    bytes (and so the documented signature) are those of the example above."""
    with_digest = Announcement(**{**A.__dict__, "digest": "cd" * 32})
    assert signing.canonical_bytes("run1", with_digest) == signing.canonical_bytes("run1", A) + b"64:" + b"cd" * 32 + b","
    a = signing.signed(KEY, "run1", with_digest)
    assert signing.check(KEY, "run1", decode_announcement(encode_announcement(a))) is None
    assert signing.check(KEY, "run1", Announcement(**{**a.__dict__, "digest": "ef" * 32})) == "bad_signature"
    assert signing.check(KEY, "run1", Announcement(**{**a.__dict__, "digest": ""})) == "bad_signature"


def test_key_file_is_private_and_a_missing_or_bad_one_is_a_clear_start_up_error(tmp_path):
    path = signing.write_key_file(tmp_path / "k" / "announce.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = signing.read_key_file(path)
    assert len(key) == 32 and signing.write_key_file(path) == path and signing.read_key_file(path) == key  # kept
    with pytest.raises(signing.AnnounceKeyError, match="announce_key_file"):
        signing.announce_key("hmac", "")
    with pytest.raises(signing.AnnounceKeyError, match="cannot read the announcement key"):
        signing.announce_key("hmac", str(tmp_path / "missing.key"))
    (tmp_path / "short.key").write_text("abcd\n")
    with pytest.raises(signing.AnnounceKeyError, match="64 hex digits"):
        signing.announce_key("hmac", str(tmp_path / "short.key"))
    assert signing.announce_key("insecure", "") is None
    assert signing.announce_key("hmac", str(path)) == key
