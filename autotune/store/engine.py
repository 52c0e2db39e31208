"""Opening a store: what AUTOTUNE_DB names, the checks before trusting it, and its migrations.

`AUTOTUNE_DB` is a SQLite path (the embedded default) or a URL: `sqlite:///path`, or
`postgresql://user:password@host:5432/db` (psycopg 3 is the driver either way it is spelled).

Before a SQLite file is used it must look like what it claims: a file of 0 bytes that exists
before we open it is refused (SQLite would treat it as an empty database, and every result the
user expected would be silently gone), and `PRAGMA quick_check` must pass, so a damaged file is
one line naming it and how to recover rather than a traceback later.

`migrate` brings the schema to the newest revision with Alembic, inside a lock the database holds
(SQLite's write lock, PostgreSQL's transaction-level advisory lock), so N workers or nodes
starting at once migrate exactly once. A database written by an older autotune (schema 1: no
Alembic table) is stamped at revision 0001 first; one from a newer autotune is refused.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Connection, Engine, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from autotune.errors import StoreError

MIGRATIONS = Path(__file__).parent / "migrations"
SCHEMA_VERSION = 2  # SQLite's user_version: a schema-1 autotune refuses a newer file by it
_LOCK_KEY = 0x6175_746F  # "auto": PostgreSQL advisory lock id for migrations


def database_url(value: str | Path) -> URL:
    """The SQLAlchemy URL for AUTOTUNE_DB. Raises StoreError naming the variable."""
    raw = str(value).strip()
    if "://" not in raw:
        return URL.create("sqlite", database=str(Path(raw).expanduser().absolute()))
    try:
        url = make_url(raw)
    except ArgumentError:
        raise StoreError(f"AUTOTUNE_DB {raw!r} is not a database URL: give a SQLite path or postgresql://...") from None
    backend = url.get_backend_name()
    if backend == "postgresql":
        return url.set(drivername="postgresql+psycopg")
    if backend == "sqlite" and url.database not in (None, "", ":memory:"):
        return url.set(drivername="sqlite")
    raise StoreError(
        f"AUTOTUNE_DB {url.render_as_string(hide_password=True)!r}: use a SQLite file path or a "
        "postgresql://user:password@host:5432/db URL"
    )


def describe(url: URL) -> str:
    """The database for messages: a SQLite file's path, or the URL without its password."""
    if url.get_backend_name() == "sqlite":
        return str(url.database)
    return url.render_as_string(hide_password=True)


def check_sqlite_file(path: Path) -> None:
    """Refuse a SQLite file that cannot be a store: missing directory, 0 bytes, damaged."""
    if not path.parent.is_dir():
        raise StoreError(f"cannot open the database {path}: directory {path.parent} does not exist (AUTOTUNE_DB)")
    if not path.exists():
        return
    if path.is_dir():
        raise StoreError(f"the database {path} is a directory: point AUTOTUNE_DB at a file")
    if path.stat().st_size == 0:
        raise StoreError(
            f"the database {path} is an empty file (0 bytes), not a store: its results are gone; "
            "restore it from a backup, or delete it to start an empty store"
        )
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        try:
            rows = db.execute("PRAGMA quick_check(5)").fetchall()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise StoreError(_damaged(path, str(exc))) from None
    problems = [str(row[0]) for row in rows if row[0] != "ok"]
    if problems:
        raise StoreError(_damaged(path, _first_problem(problems)))


def _first_problem(rows: list[str]) -> str:
    """quick_check's rows as one line: its first finding, whole, and how many more there are.
    A row may hold several lines ("*** in database main ***" then one per finding), and cutting the
    joined rows to a length left a message of several lines ending mid-word."""
    findings = [
        line.strip() for row in rows for line in row.splitlines() if line.strip() and not line.startswith("***")
    ]
    if not findings:
        return "PRAGMA quick_check failed"
    first = findings[0] if len(findings[0]) <= 160 else findings[0][:160].rsplit(" ", 1)[0] + " ..."
    more = len(findings) - 1
    return first if not more else f"{first}; and {more} more such finding{'s' if more > 1 else ''}"


def _damaged(path: Path, why: str) -> str:
    why = " ".join(why.split())  # one line, whatever the driver said
    return (
        f"the database {path} is damaged ({why}): restore it from a backup, or move it aside "
        f"(mv {path} {path}.damaged) to start an empty store"
    )


def create(url: URL) -> Engine:
    """An engine for the store: WAL and immediate write transactions on SQLite, a checked pool on
    PostgreSQL. Raises StoreError when the database cannot be reached."""
    if url.get_backend_name() == "sqlite":
        check_sqlite_file(Path(str(url.database)))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 10.0})
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
    else:
        engine = create_engine(
            # Small: a cluster's nodes x workers share PostgreSQL's max_connections (100 by default).
            url,
            pool_pre_ping=True,
            pool_size=2,
            max_overflow=8,
            connect_args={"connect_timeout": 10},
        )
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        engine.dispose()
        raise StoreError(f"cannot open the database {describe(url)}: {reason(exc)} (AUTOTUNE_DB)") from None
    return engine


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # The driver's own transaction handling is off: `_sqlite_begin` says BEGIN itself.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        # WAL: readers never block the writer, and a kill -9 loses at most the transaction in flight.
        mode = cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot use WAL journaling (got {mode!r})")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # A write transaction takes the write lock at BEGIN: a deferred one that reads first and then
    # writes fails at once with "database is locked" when another process wrote in between,
    # instead of waiting its turn under the busy timeout.
    immediate = conn.get_execution_options().get("immediate", False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def reason(exc: SQLAlchemyError) -> str:
    original = getattr(exc, "orig", None)
    lines = str(original if original is not None else exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision, once, whoever else is starting."""
    url = engine.url
    script = ScriptDirectory(str(MIGRATIONS))
    known = {rev.revision for rev in script.walk_revisions()}
    try:
        with engine.connect() as conn:
            conn.execution_options(immediate=True)
            with conn.begin():
                if url.get_backend_name() == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
                tables, current = _written_by(conn, url)
                if current is not None and current not in known:
                    raise StoreError(_newer(url, f"revision {current}"))
                config = Config()
                config.set_main_option("script_location", str(MIGRATIONS))
                config.attributes["connection"] = conn
                if current is None and "results" in tables:
                    command.stamp(config, "0001")  # a schema-1 file: its tables exist already
                if current != script.get_current_head():
                    command.upgrade(config, "head")
                if url.get_backend_name() == "sqlite":
                    conn.exec_driver_sql(f"PRAGMA user_version={SCHEMA_VERSION}")
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot prepare the database {describe(url)}: {reason(exc)}") from None


def _written_by(conn: Connection, url: URL) -> tuple[set[str], str | None]:
    """The database's tables and Alembic revision (None: none recorded); StoreError when a SQLite
    file says a newer autotune wrote it (its user_version)."""
    tables = set(inspect(conn).get_table_names())
    current = None
    if "alembic_version" in tables:
        current = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    if url.get_backend_name() == "sqlite":
        version = conn.exec_driver_sql("PRAGMA user_version").scalar() or 0
        if version > SCHEMA_VERSION:
            raise StoreError(_newer(url, f"schema version {version}"))
    return tables, current


def refuse_newer(engine: Engine) -> None:
    """Raise StoreError when the database was written by a newer autotune; reads only, so that
    `autotune serve` can say so (exit 2) before it listens, and migrate afterwards."""
    url = engine.url
    known = {rev.revision for rev in ScriptDirectory(str(MIGRATIONS)).walk_revisions()}
    try:
        with engine.connect() as conn:
            _, current = _written_by(conn, url)
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot read the database {describe(url)}: {reason(exc)}") from None
    if current is not None and current not in known:
        raise StoreError(_newer(url, f"revision {current}"))


def _newer(url: URL, what: str) -> str:
    return (
        f"the database {describe(url)} has {what}, newer than this autotune knows: "
        "upgrade autotune or point AUTOTUNE_DB elsewhere"
    )
