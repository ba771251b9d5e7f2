"""The job workflow: submit → plan → quote → accept → reserve (and, later, launch and watch)."""
