"""control + service: jobs, quotes, contracts, leases, ledger, events

Why: a job becomes a binding trade. Leases are the control layer's record of GPUs taken at a
cluster (the capacity view subtracts active ones); the ledger is append-only, so invoices and
provider payouts are sums of entries; events give every job transition a trace.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 21:24:06.476451
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table('events',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('subtask', sa.String(length=130), nullable=True),
    sa.Column('type', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.String(length=63), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_job'), ['job'], unique=False)

    op.create_table('jobs',
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('labels', JSON, nullable=False),
    sa.Column('spec', JSON, nullable=False),
    sa.Column('status', JSON, nullable=False),
    sa.Column('owner_id', sa.String(length=36), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], name=op.f('fk_jobs_owner_id_accounts'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('name', name=op.f('uq_jobs_name')),
    sa.UniqueConstraint('owner_id', 'idempotency_key', name='uq_jobs_owner_idem')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_phase'), ['phase'], unique=False)

    op.create_table('quotes',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('label', sa.String(length=16), nullable=False),
    sa.Column('strategy', sa.String(length=16), nullable=False),
    sa.Column('placement', JSON, nullable=False),
    sa.Column('ring', JSON, nullable=False),
    sa.Column('prediction', JSON, nullable=False),
    sa.Column('predicted_seconds', sa.Float(), nullable=False),
    sa.Column('wan_gb', sa.Float(), nullable=False),
    sa.Column('total', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('lines', JSON, nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_quotes_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_quotes'))
    )
    with op.batch_alter_table('quotes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_quotes_job_id'), ['job_id'], unique=False)

    op.create_table('contracts',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('quote_id', sa.String(length=36), nullable=False),
    sa.Column('account_id', sa.String(length=36), nullable=False),
    sa.Column('quoted_total', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_contracts_job_id_jobs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['quote_id'], ['quotes.id'], name=op.f('fk_contracts_quote_id_quotes'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_contracts'))
    )
    with op.batch_alter_table('contracts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_contracts_account_id'), ['account_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_contracts_job_id'), ['job_id'], unique=False)

    op.create_table('leases',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('subtask', sa.String(length=130), nullable=False),
    sa.Column('contract_id', sa.String(length=36), nullable=True),
    sa.Column('cluster_id', sa.String(length=36), nullable=False),
    sa.Column('cluster', sa.String(length=63), nullable=False),
    sa.Column('owner_id', sa.String(length=36), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('reason', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], name=op.f('fk_leases_cluster_id_clusters'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_leases'))
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index('ix_leases_cluster_state', ['cluster_id', 'state'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_contract_id'), ['contract_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_job'), ['job'], unique=False)
        batch_op.create_index(batch_op.f('ix_leases_owner_id'), ['owner_id'], unique=False)

    op.create_table('ledger_entries',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('contract_id', sa.String(length=36), nullable=False),
    sa.Column('job', sa.String(length=63), nullable=False),
    sa.Column('account_id', sa.String(length=36), nullable=False),
    sa.Column('provider', sa.String(length=63), nullable=False),
    sa.Column('provider_account_id', sa.String(length=36), nullable=False),
    sa.Column('cluster', sa.String(length=63), nullable=False),
    sa.Column('item', sa.String(length=16), nullable=False),
    sa.Column('quantity', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('unit_price', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('amount', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('note', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resource_version', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['contract_id'], ['contracts.id'], name=op.f('fk_ledger_entries_contract_id_contracts'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_ledger_entries'))
    )
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ledger_entries_account_id'), ['account_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_entries_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_entries_contract_id'), ['contract_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_entries_job'), ['job'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_entries_provider_account_id'), ['provider_account_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ledger_entries_provider_account_id'))
        batch_op.drop_index(batch_op.f('ix_ledger_entries_job'))
        batch_op.drop_index(batch_op.f('ix_ledger_entries_contract_id'))
        batch_op.drop_index(batch_op.f('ix_ledger_entries_at'))
        batch_op.drop_index(batch_op.f('ix_ledger_entries_account_id'))

    op.drop_table('ledger_entries')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_leases_owner_id'))
        batch_op.drop_index(batch_op.f('ix_leases_job'))
        batch_op.drop_index(batch_op.f('ix_leases_contract_id'))
        batch_op.drop_index('ix_leases_cluster_state')

    op.drop_table('leases')
    with op.batch_alter_table('contracts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_contracts_job_id'))
        batch_op.drop_index(batch_op.f('ix_contracts_account_id'))

    op.drop_table('contracts')
    with op.batch_alter_table('quotes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_quotes_job_id'))

    op.drop_table('quotes')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_phase'))
        batch_op.drop_index(batch_op.f('ix_jobs_owner_id'))

    op.drop_table('jobs')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_job'))
        batch_op.drop_index(batch_op.f('ix_events_at'))

    op.drop_table('events')
