"""job namespaces: each user has their own job names

Why: job names were global, so bob could not have a job `lm` once alice had one (and names could be
squatted). A job is now stored under "<owner account>/<name>" (users still write `lm`); the columns
that name jobs widen to hold that key, and existing jobs move into their owners' namespaces.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY, SUBTASK, LAUNCH = 127, 200, 400
# (table, column, old length, new length, nullable)
WIDEN = [
    ('jobs', 'name', 63, KEY, False),
    ('tokens', 'job', 63, KEY, True),
    ('events', 'job', 63, KEY, False),
    ('events', 'subtask', 130, SUBTASK, True),
    ('subtasks', 'job', 63, KEY, False),
    ('subtasks', 'name', 130, SUBTASK, False),
    ('subtasks', 'launch_key', 220, LAUNCH, False),
    ('subtask_logs', 'job', 63, KEY, False),
    ('subtask_logs', 'subtask', 130, SUBTASK, False),
    ('job_metrics', 'job', 63, KEY, False),
    ('leases', 'job', 63, KEY, False),
    ('leases', 'subtask', 130, SUBTASK, False),
    ('contracts', 'job', 63, KEY, False),
    ('ledger_entries', 'job', 63, KEY, False),
]
REFERENCES = [(t, c) for t, c, *_ in WIDEN if c == 'job']


def _resize(new: bool) -> None:
    for table, column, old, wide, nullable in WIDEN:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, existing_type=sa.String(old if new else wide),
                               type_=sa.String(wide if new else old), existing_nullable=nullable)


def upgrade() -> None:
    _resize(True)
    conn = op.get_bind()
    rows = conn.execute(sa.text(
        "SELECT jobs.name, accounts.name FROM jobs JOIN accounts ON accounts.id = jobs.owner_id "
        "WHERE jobs.name NOT LIKE '~%' AND jobs.name NOT LIKE '%/%'")).all()
    for name, owner in rows:
        for table, column in REFERENCES:
            conn.execute(sa.text(f"UPDATE {table} SET {column} = :key WHERE {column} = :name"),
                         {"key": f"{owner}/{name}", "name": name})
        conn.execute(sa.text("UPDATE jobs SET name = :key WHERE name = :name"), {"key": f"{owner}/{name}", "name": name})


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT name FROM jobs WHERE name LIKE '%/%'")).all()
    for (key,) in rows:
        name = key.split('/', 1)[1]
        for table, column in [*REFERENCES, ('jobs', 'name')]:
            conn.execute(sa.text(f"UPDATE {table} SET {column} = :name WHERE {column} = :key"), {"key": key, "name": name})
    _resize(False)
