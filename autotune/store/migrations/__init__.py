"""Alembic migrations of the store, run by `autotune.store.engine.migrate` (never by hand)."""
