"""calibrations: what finished runs taught the compute model

Why: quotes missed the runs by 2-3x (a fixed 120 s start-up and textbook MFU). Every job that
succeeds on its first attempt now updates, per (GPU model, strategy, workload), the ratio of its
measured training time to the model's prediction and its measured start-up time; later quotes use
them (`cpnctl get calibration` shows them).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 02:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'calibrations',
        sa.Column('gpu_model', sa.String(length=64), nullable=False),
        sa.Column('strategy', sa.String(length=16), nullable=False),
        sa.Column('workload', sa.String(length=32), nullable=False),
        sa.Column('step_factor', sa.Float(), nullable=False),
        sa.Column('startup_seconds', sa.Float(), nullable=False),
        sa.Column('samples', sa.Integer(), nullable=False),
        sa.Column('last_ratio', sa.Float(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('resource_version', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('gpu_model', 'strategy', 'workload'),
    )


def downgrade() -> None:
    op.drop_table('calibrations')
