"""resource layer: sites, clusters, links

Why: the inventory every placement rests on. Clusters reference their site and links both
ends with RESTRICT, so a site in use cannot vanish; `pair_key` (the two site names, sorted)
makes one link per unordered pair a database rule, not just a check in code.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 21:15:56.578070
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table('sites',
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('labels', JSON, nullable=False),
    sa.Column('spec', JSON, nullable=False),
    sa.Column('status', JSON, nullable=False),
    sa.Column('owner_id', sa.String(length=36), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], name=op.f('fk_sites_owner_id_accounts'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sites')),
    sa.UniqueConstraint('name', name=op.f('uq_sites_name'))
    )
    with op.batch_alter_table('sites', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sites_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_sites_region'), ['region'], unique=False)

    op.create_table('clusters',
    sa.Column('site_id', sa.String(length=36), nullable=False),
    sa.Column('driver', sa.String(length=16), nullable=False),
    sa.Column('capacity_gpus', sa.Integer(), nullable=False),
    sa.Column('allocatable_gpus', sa.Integer(), nullable=False),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('labels', JSON, nullable=False),
    sa.Column('spec', JSON, nullable=False),
    sa.Column('status', JSON, nullable=False),
    sa.Column('owner_id', sa.String(length=36), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], name=op.f('fk_clusters_owner_id_accounts'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['site_id'], ['sites.id'], name=op.f('fk_clusters_site_id_sites'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_clusters')),
    sa.UniqueConstraint('name', name=op.f('uq_clusters_name'))
    )
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_clusters_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_clusters_site_id'), ['site_id'], unique=False)

    op.create_table('links',
    sa.Column('site_a_id', sa.String(length=36), nullable=False),
    sa.Column('site_b_id', sa.String(length=36), nullable=False),
    sa.Column('pair_key', sa.String(length=130), nullable=False),
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('labels', JSON, nullable=False),
    sa.Column('spec', JSON, nullable=False),
    sa.Column('status', JSON, nullable=False),
    sa.Column('owner_id', sa.String(length=36), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], name=op.f('fk_links_owner_id_accounts'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['site_a_id'], ['sites.id'], name=op.f('fk_links_site_a_id_sites'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['site_b_id'], ['sites.id'], name=op.f('fk_links_site_b_id_sites'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_links')),
    sa.UniqueConstraint('name', name=op.f('uq_links_name')),
    sa.UniqueConstraint('pair_key', name=op.f('uq_links_pair_key'))
    )
    with op.batch_alter_table('links', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_links_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_links_site_a_id'), ['site_a_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_links_site_b_id'), ['site_b_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('links', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_links_site_b_id'))
        batch_op.drop_index(batch_op.f('ix_links_site_a_id'))
        batch_op.drop_index(batch_op.f('ix_links_owner_id'))

    op.drop_table('links')
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_clusters_site_id'))
        batch_op.drop_index(batch_op.f('ix_clusters_owner_id'))

    op.drop_table('clusters')
    with op.batch_alter_table('sites', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sites_region'))
        batch_op.drop_index(batch_op.f('ix_sites_owner_id'))

    op.drop_table('sites')
