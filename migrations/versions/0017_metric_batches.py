"""metric_batches: a metric batch re-sent after a lost answer is stored once

Why: a runner whose metrics POST was committed just before the API died never saw the answer, sent
the same reports again, and they were stored twice (issue 36, item 6: 11 rows). The runner now names
each batch once (`batchId`, kept across its retries); the server records the ids it stored, per job,
in the same transaction as the reports, and answers a batch it already holds with what it stored.
Batches without an id (older runners) are stored as before.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0017'
down_revision: str | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'metric_batches',
        sa.Column('job', sa.String(length=127), nullable=False),
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('accepted', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('resource_version', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('job', 'id', name=op.f('pk_metric_batches')),
    )


def downgrade() -> None:
    op.drop_table('metric_batches')
