"""Relay reward service: a FastAPI batch scoring endpoint in front of a plugin registry."""
