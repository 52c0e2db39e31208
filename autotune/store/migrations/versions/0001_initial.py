"""Schema 1: results, their request keys, jobs and trials (what one SQLite server stored).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "results",
        sa.Column("fingerprint", sa.String(64), primary_key=True),
        sa.Column("document", sa.Text, nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("stored_at", sa.String(40), nullable=False),
    )
    op.create_table(
        "result_keys",
        sa.Column("request_key", sa.String(64), primary_key=True),
        sa.Column("fingerprint", sa.String(64), sa.ForeignKey("results.fingerprint"), nullable=False),
        sa.Column("stored_at", sa.String(40), nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("request_key", sa.String(64), nullable=False),
        sa.Column("workload", sa.Text, nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("started_at", sa.String(40)),
        sa.Column("finished_at", sa.String(40)),
        sa.Column("fingerprint", sa.String(64)),
        sa.Column("error_type", sa.String(64)),
        sa.Column("error_message", sa.Text),
    )
    op.create_index("jobs_by_status", "jobs", ["status"])
    op.create_table(
        "trials",
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("document", sa.Text, nullable=False),
    )


def downgrade() -> None:
    for table in ("trials", "jobs", "result_keys", "results"):
        op.drop_table(table)
