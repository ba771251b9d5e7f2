"""user metrics: job_metrics.extra

Why: jobs bring their own code (spec.code) and report their own metrics through cpn.train's
`trainer.report(accuracy=…)`; they are kept per report as a JSON object of camelCase names to
numbers and shown next to CPN's own columns in GET /api/v1/jobs/{name}/metrics.

Revision ID: 0009
Revises: 0006
Create Date: 2026-11-23 01:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0009'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('extra', JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.drop_column('extra')
