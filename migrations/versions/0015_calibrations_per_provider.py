"""calibrations: per provider, with each run's evidence

Why: one odd run poisoned every quote. A one-step job moved the H100/ddp/lm step factor from 44,691
to 687,902 (its fixed per-run costs divided by one step's prediction), and the row was shared by
every provider, so a provider whose "H100" is a CPU slot priced H100 for everyone. Rows are now kept
per provider as well (rows learned before this revision stay under provider '', the unscoped
fallback), and carry the evidence the runs gave (`evidence`, the averaging weight follows it; old
rows count each run as full evidence) and the last run's own, undamped factor (`last_observed`).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = ['gpu_model', 'strategy', 'workload']


def _replace_key(columns: list[str]) -> None:
    """The primary key over `columns`: SQLite rebuilds the table (batch), PostgreSQL swaps the constraint."""
    bind = op.get_bind()
    if bind.dialect.name == 'sqlite':  # rebuilt from the table as it stands, with the new key
        now = sa.Table('calibrations', sa.MetaData(), autoload_with=bind)
        table = sa.Table('calibrations', sa.MetaData(),
                         *(sa.Column(c.name, c.type, nullable=c.nullable, server_default=c.server_default)
                           for c in now.columns), sa.PrimaryKeyConstraint(*columns, name='pk_calibrations'))
        with op.batch_alter_table('calibrations', recreate='always', copy_from=table):
            pass
        return
    old = sa.inspect(bind).get_pk_constraint('calibrations')['name']  # 0010 left the server's own name
    op.drop_constraint(old, 'calibrations', type_='primary')
    op.create_primary_key('pk_calibrations', 'calibrations', columns)


def upgrade() -> None:
    with op.batch_alter_table('calibrations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('provider', sa.String(length=64), nullable=False, server_default=''))
        batch_op.add_column(sa.Column('evidence', sa.Float(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('last_observed', sa.Float(), nullable=True))
    op.execute("UPDATE calibrations SET evidence = samples")
    _replace_key([*KEY, 'provider'])


def downgrade() -> None:
    # two providers' rows of one (model, strategy, workload) cannot share the old key: keep the best-evidenced
    op.execute("DELETE FROM calibrations WHERE EXISTS (SELECT 1 FROM calibrations o WHERE "
               "o.gpu_model = calibrations.gpu_model AND o.strategy = calibrations.strategy AND "
               "o.workload = calibrations.workload AND (o.evidence > calibrations.evidence OR "
               "(o.evidence = calibrations.evidence AND o.provider < calibrations.provider)))")
    _replace_key(KEY)
    with op.batch_alter_table('calibrations', schema=None) as batch_op:
        batch_op.drop_column('last_observed')
        batch_op.drop_column('evidence')
        batch_op.drop_column('provider')
