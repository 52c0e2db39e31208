"""One module a schema revision, applied in order by Alembic."""
