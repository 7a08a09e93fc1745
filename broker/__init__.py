"""Relay broker: the wire protocol, the client library every service uses, and the ingest service."""
