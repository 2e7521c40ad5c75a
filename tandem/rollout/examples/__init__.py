"""Shipped example agents (see docs/agentic.md)."""
