"""rate_buckets: rate limits that hold across API replicas

Why: the per-token rate limit was a token bucket in each server's memory, so N replicas on one
PostgreSQL allowed N times the limit. A row per token (GCRA: its theoretical arrival time) is
updated by one conditional upsert per request, in the database's clock, by whichever replica
serves it. SQLite (one process) keeps the in-memory bucket and never writes this table.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24 20:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'rate_buckets',
        sa.Column('key', sa.String(length=64), nullable=False),
        sa.Column('tat', sa.Float(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('resource_version', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('key', name=op.f('pk_rate_buckets')),
    )


def downgrade() -> None:
    op.drop_table('rate_buckets')
