"""teams, team_members, quotas: what one account or team may hold and use

Why: nothing limited what one account could hold or spend: one user could lease every GPU of the
network with one accept (issue 31, item 2). A Team names accounts (its members, also kept as rows so
that an account's teams are one indexed lookup); a Quota binds one account or one team and caps GPUs
held, active jobs, and GPU-hours and spend per calendar month. Accepts lock the quota rows that bind
the job's owner, so `quotas.account` and `quotas.team` are indexed columns, not only spec fields.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0018'
down_revision: str | None = '0017'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _manifest_table(name: str, *extra: sa.Column) -> None:
    op.create_table(name,
    *extra,
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('labels', JSON, nullable=False),
    sa.Column('spec', JSON, nullable=False),
    sa.Column('status', JSON, nullable=False),
    sa.Column('owner_id', sa.String(length=36), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], name=op.f(f'fk_{name}_owner_id_accounts'),
                            ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f(f'pk_{name}')),
    sa.UniqueConstraint('name', name=op.f(f'uq_{name}_name'))
    )
    with op.batch_alter_table(name, schema=None) as batch_op:
        batch_op.create_index(batch_op.f(f'ix_{name}_owner_id'), ['owner_id'], unique=False)


def upgrade() -> None:
    _manifest_table('teams')
    op.create_table('team_members',
    sa.Column('team_id', sa.String(length=36), nullable=False),
    sa.Column('account', sa.String(length=63), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['team_id'], ['teams.id'], name=op.f('fk_team_members_team_id_teams'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('team_id', 'account', name=op.f('pk_team_members'))
    )
    with op.batch_alter_table('team_members', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_team_members_account'), ['account'], unique=False)
    _manifest_table('quotas', sa.Column('account', sa.String(length=63), nullable=True),
                    sa.Column('team', sa.String(length=63), nullable=True))
    with op.batch_alter_table('quotas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_quotas_account'), ['account'], unique=False)
        batch_op.create_index(batch_op.f('ix_quotas_team'), ['team'], unique=False)


def downgrade() -> None:
    op.drop_table('quotas')
    op.drop_table('team_members')
    op.drop_table('teams')
