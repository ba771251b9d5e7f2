"""site agents: desired vs reported sub-task state, rendezvous, shipped logs

Why: sites are other machines. The API server no longer starts workers; it writes each sub-task's
desired state (`desired`: Run | Stop) and the agent at the site claims it, launches it and reports
its phase and exit codes. The sub-task holding global rank 0 stores the rendezvous endpoint its
agent advertises. Worker output is shipped by the agents into `subtask_logs`, so `cpnctl logs`
works for every attempt whatever site or replica held it.

Revision ID: 0006
Revises: 0004
Create Date: 2026-11-22 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0006'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table('subtasks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('desired', sa.String(length=8), nullable=False, server_default='Run'))
        batch_op.add_column(sa.Column('reported', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('first_rank', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('rendezvous', JSON, nullable=True))
        batch_op.add_column(sa.Column('exit_codes', JSON, nullable=False, server_default='{}'))
        batch_op.add_column(sa.Column('claimed_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('reported_at', sa.DateTime(timezone=True), nullable=True))
    op.create_table('subtask_logs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('subtask', sa.String(length=130), nullable=False),
    sa.Column('site', sa.String(length=63), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('line', sa.Text(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_subtask_logs'))
    )
    with op.batch_alter_table('subtask_logs', schema=None) as batch_op:
        batch_op.create_index('ix_subtask_logs_job_attempt', ['job', 'attempt', 'id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('subtask_logs', schema=None) as batch_op:
        batch_op.drop_index('ix_subtask_logs_job_attempt')
    op.drop_table('subtask_logs')
    with op.batch_alter_table('subtasks', schema=None) as batch_op:
        for column in ('reported_at', 'claimed_at', 'exit_codes', 'rendezvous', 'first_rank', 'reported', 'desired'):
            batch_op.drop_column(column)
