"""Announcement signatures (broker/protocol/signing.py): Ed25519 by the learner's private key, checked with
the public key; what the signature covers, as docs/protocol.md states it."""

import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from broker.protocol import signing
from broker.protocol.messages import Announcement, decode_announcement, encode_announcement

KEY = signing.AnnounceSigner(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))  # the documented example's
PUBLIC = signing.AnnounceVerifier(KEY.public)  # what the broker and the generators hold
A = Announcement(version=7, hash="ab" * 32, path="/store/v000007", url="", published_at=1700000000.25)


def test_canonical_bytes_and_signature_match_the_documented_example():
    # the example of docs/protocol.md ("Announcement signature"): a producer in another language reproduces it
    assert signing.canonical_bytes("run1", A) == (
        b"17:relay-announce-v2,1:1,4:run1,1:7,64:" + b"ab" * 32 + b",14:/store/v000007,0:,17:1700000000.250000,"
    )
    # private key seed = bytes 0x00..0x1f (RFC 8032 Ed25519 is deterministic: the same signature everywhere)
    assert KEY.public_hex == "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    assert signing.signature(KEY, "run1", A) == (
        "0f373c1bba848dc1dd3f4d24d1a86442843024814cef319fd03bf3117dcb8cf1"
        "40359115eeec2d3bd90477f346d2a606b76628eb2d1cfc7698ad67076b2cec0b"
    )


def test_every_field_and_the_run_are_covered_and_only_the_private_key_signs():
    a = signing.signed(KEY, "run1", Announcement(**{**A.__dict__}))
    assert signing.check(PUBLIC, "run1", a) is None
    # the signature survives the wire
    assert signing.check(PUBLIC, "run1", decode_announcement(encode_announcement(a))) is None
    for change in (
        {"version": 8},
        {"hash": "cd" * 32},
        {"path": "/attacker/v000007"},
        {"url": "http://evil"},
        {"published_at": 1700000000.5},
    ):
        forged = Announcement(**{**a.__dict__, **change})
        assert signing.check(PUBLIC, "run1", forged) == "bad_signature", change
    assert signing.check(PUBLIC, "run2", a) == "bad_signature"  # replayed into another run
    other = signing.AnnounceSigner.generate()
    assert signing.check(PUBLIC, "run1", signing.signed(other, "run1", Announcement(**A.__dict__))) == "bad_signature"
    assert signing.check(PUBLIC, "run1", Announcement(**{**a.__dict__, "sig": ""})) == "unsigned"
    assert signing.check(PUBLIC, "run1", Announcement(**{**a.__dict__, "sig": "zz" * 64})) == "bad_signature"
    assert not hasattr(PUBLIC, "sign")  # what the broker and the generators hold cannot sign


def test_the_tensor_digest_is_signed_as_a_ninth_netstring_and_cannot_be_swapped_or_stripped():
    """docs/protocol.md 6.1.1: with a digest, its netstring follows the eight values; without one the
    bytes (and so the documented signature) are those of the example above."""
    with_digest = Announcement(**{**A.__dict__, "digest": "cd" * 32})
    assert (
        signing.canonical_bytes("run1", with_digest) == signing.canonical_bytes("run1", A) + b"64:" + b"cd" * 32 + b","
    )
    a = signing.signed(KEY, "run1", with_digest)
    assert signing.check(PUBLIC, "run1", decode_announcement(encode_announcement(a))) is None
    assert signing.check(PUBLIC, "run1", Announcement(**{**a.__dict__, "digest": "ef" * 32})) == "bad_signature"
    assert signing.check(PUBLIC, "run1", Announcement(**{**a.__dict__, "digest": ""})) == "bad_signature"


def test_key_files_private_public_and_clear_start_up_errors(tmp_path):
    private, public = signing.write_key_pair(tmp_path / "k" / "announce.key", tmp_path / "k" / "announce.pub")
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    signer, verifier = signing.read_signer(private), signing.read_verifier(public)
    assert public.read_text() == signer.public_hex + "\n" and verifier.public_hex == signer.public_hex
    signing.write_key_pair(private, public)  # kept: a resumed run signs with the same key
    assert signing.read_signer(private).public_hex == signer.public_hex
    with pytest.raises(signing.AnnounceKeyError, match="announce_key_file"):
        signing.announce_signer("ed25519", "")
    with pytest.raises(signing.AnnounceKeyError, match="announce_public_key_file"):
        signing.announce_verifier("ed25519", "")
    with pytest.raises(signing.AnnounceKeyError, match="cannot read the announcement public key"):
        signing.announce_verifier("ed25519", str(tmp_path / "missing.pub"))
    (tmp_path / "short.pub").write_text("abcd\n")
    with pytest.raises(signing.AnnounceKeyError, match="64 hex digits"):
        signing.announce_verifier("ed25519", str(tmp_path / "short.pub"))
    # a generator given the private key by mistake refuses it: whoever steals its files could sign
    with pytest.raises(signing.AnnounceKeyError, match="PRIVATE"):
        signing.announce_verifier("ed25519", str(private))
    assert signing.announce_signer("insecure", "") is None and signing.announce_verifier("insecure", "") is None
    assert signing.announce_verifier("ed25519", str(public)).public_hex == signer.public_hex


def test_an_hmac_key_of_a_run_from_before_ed25519_is_refused_saying_so(tmp_path):
    old = tmp_path / "announce.key"
    old.write_text(os.urandom(32).hex() + "\n")  # what runs wrote before: 64 hex digits every service held
    with pytest.raises(signing.AnnounceKeyError, match="HMAC announcement key"):
        signing.announce_signer("ed25519", str(old))
    with pytest.raises(signing.AnnounceKeyError, match="HMAC"):
        signing.write_key_pair(old, tmp_path / "announce.pub")  # relay up --resume never keeps using it


def test_the_announce_auth_hmac_setting_is_refused_with_the_reason():
    from broker.config import BrokerConfig
    from broker.runtime.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="'hmac' was removed"):
        load_config(BrokerConfig, overrides={"announce_auth": "hmac"})
