"""datasets: a user's data and the sites where its replicas live

Why: a job could only train on data shipped in its code bundle or fetched by its own code, so CPN
could neither price moving the data nor keep it where residency rules require. A Dataset (per
owner, like jobs: "<owner>/<name>") records its size, format, replica locations and allowed
regions; placement prices copies to sites without a replica (`data-transfer`) and stays inside
the regions, and each site's workers get their replica's URI.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24 20:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

JSON = sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'datasets',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('name', sa.String(length=127), nullable=False),
        sa.Column('labels', JSON, nullable=False),
        sa.Column('spec', JSON, nullable=False),
        sa.Column('status', JSON, nullable=False),
        sa.Column('owner_id', sa.String(length=36), nullable=False),
        sa.Column('size_gb', sa.Float(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('resource_version', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], name=op.f('fk_datasets_owner_id_accounts'), ondelete='RESTRICT'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_datasets')),
        sa.UniqueConstraint('name', name=op.f('uq_datasets_name')),
    )
    op.create_index(op.f('ix_datasets_owner_id'), 'datasets', ['owner_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_datasets_owner_id'), table_name='datasets')
    op.drop_table('datasets')
