"""Schema 3: jobs outlive the workers that run them, and say what they wait for.

Jobs gain `interruptions` (how often the worker running one stopped: the job is queued again, under
its id, until a limit) and `waiting` (while a claimed job waits for its device's lock: the holder
and since when, as JSON). Existing rows get 0 and nothing.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("interruptions", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("waiting", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("waiting")
        batch.drop_column("interruptions")
