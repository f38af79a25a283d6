"""Lanes and the registry, tile-configuration tables, and (later) targets."""
