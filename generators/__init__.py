"""Relay generators: one process per inference replica; backends behind one interface."""
