"""orchestration lifecycle: sub-tasks and metric reports

Why: the reconciler keeps all of a running job's state in the database so that an API-server
restart loses nothing. `launch_key` (job/sub-task/attempt) is unique, which makes a launch a
thing that happens once per attempt; job_metrics holds the loss curve and meters billing.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 21:27:02.453877
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table('job_metrics',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('site', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('tokens', sa.Integer(), nullable=False),
    sa.Column('train_loss', sa.Float(), nullable=True),
    sa.Column('val_loss', sa.Float(), nullable=True),
    sa.Column('tokens_per_second', sa.Float(), nullable=False),
    sa.Column('wall_seconds', sa.Float(), nullable=False),
    sa.Column('wan_bytes', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_metrics'))
    )
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_metrics_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_job_metrics_job'), ['job'], unique=False)

    op.create_table('subtasks',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('name', sa.String(length=130), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('launch_key', sa.String(length=220), nullable=False),
    sa.Column('cluster', sa.String(length=63), nullable=False),
    sa.Column('site', sa.String(length=63), nullable=False),
    sa.Column('site_index', sa.Integer(), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('driver', sa.String(length=16), nullable=False),
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('handle', JSON, nullable=False),
    sa.Column('launches', sa.Integer(), nullable=False),
    sa.Column('launched_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_subtasks')),
    sa.UniqueConstraint('launch_key', name=op.f('uq_subtasks_launch_key'))
    )
    with op.batch_alter_table('subtasks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_subtasks_cluster'), ['cluster'], unique=False)
        batch_op.create_index(batch_op.f('ix_subtasks_job'), ['job'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('subtasks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_subtasks_job'))
        batch_op.drop_index(batch_op.f('ix_subtasks_cluster'))

    op.drop_table('subtasks')
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_metrics_job'))
        batch_op.drop_index(batch_op.f('ix_job_metrics_at'))

    op.drop_table('job_metrics')
