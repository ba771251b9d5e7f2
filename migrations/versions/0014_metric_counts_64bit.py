"""job_metrics: step and tokens as 64-bit integers

Why: a job's cumulative token count passes 2**31 at about 2.1e9 tokens (an ordinary large-model
budget), and PostgreSQL refused the metrics report with an integer-out-of-range error (a 500), so
progress, metering and billing of such a job stopped. Steps get the same width.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.alter_column('step', existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)
        batch_op.alter_column('tokens', existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.alter_column('tokens', existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
        batch_op.alter_column('step', existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
