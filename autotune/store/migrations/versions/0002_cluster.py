"""Schema 2: jobs live in the database for every worker and node.

Jobs gain the node that runs them, the worker (owner) running one and its heartbeat; at most one
queued or running job per request key (a partial unique index); device leases (one probe per
device, across processes); nodes (when a server last wrote).

Jobs a schema-1 server left queued or running belonged to a process that kept them in memory and
is gone: they are marked failed (interrupted) before the uniqueness rule is created.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ACTIVE = "status IN ('queued', 'running')"


def upgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE jobs SET status='failed', finished_at=:at, error_type='Interrupted', "
            "error_message=:message WHERE " + ACTIVE
        ).bindparams(
            at=datetime.now(UTC).isoformat(),
            message="interrupted: the server stopped while this probe was queued or running; "
            "ask for it again (POST /v1/probes) to run it",
        )
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("node", sa.String(253), nullable=False, server_default=""))
        batch.add_column(sa.Column("owner", sa.String(300)))
        batch.add_column(sa.Column("heartbeat", sa.Float))
    op.create_index("jobs_by_key", "jobs", ["request_key"])
    op.create_index("jobs_by_node_device", "jobs", ["node", "device", "status"])
    op.create_index(
        "jobs_one_active_per_key",
        "jobs",
        ["request_key"],
        unique=True,
        sqlite_where=sa.text(ACTIVE),
        postgresql_where=sa.text(ACTIVE),
    )
    op.create_table(
        "device_leases",
        sa.Column("node", sa.String(253), primary_key=True),
        sa.Column("device", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(300), nullable=False),
        sa.Column("expires", sa.Float, nullable=False),
    )
    op.create_table(
        "nodes",
        sa.Column("node", sa.String(253), primary_key=True),
        sa.Column("seen_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("nodes")
    op.drop_table("device_leases")
    op.drop_index("jobs_one_active_per_key", "jobs")
    op.drop_index("jobs_by_node_device", "jobs")
    op.drop_index("jobs_by_key", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("heartbeat")
        batch.drop_column("owner")
        batch.drop_column("node")
