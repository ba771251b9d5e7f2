"""tokens: a worker token belongs to one sub-task (one attempt, one site, its ranks)

Why: worker tokens were per job: any claim (re-claims too) minted a new one, a token of attempt 1
posted usage into attempt 2 on another cluster, and a Lost sub-task's workers went on billing
(issue 35 C1/M1, issue 36 item 2). A worker token now names the sub-task it was minted for on its
one claim (`subtask`, the sub-task's id); it is revoked when that sub-task ends. Tokens minted
before this revision keep NULL and stay valid for their job until it ends.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 13:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('subtask', sa.String(length=36), nullable=True))
        batch_op.create_index(batch_op.f('ix_tokens_subtask'), ['subtask'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tokens_subtask'))
        batch_op.drop_column('subtask')
