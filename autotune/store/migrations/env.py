"""Alembic's entry point: migrate over the connection `autotune.store.engine.migrate` hands over.

There is no alembic.ini: the store always migrates itself at start-up, inside the lock it holds.
"""

from __future__ import annotations

from alembic import context

from autotune.store.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
