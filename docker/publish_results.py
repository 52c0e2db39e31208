#!/usr/bin/env python3
"""Publish every result of a SQLite store to an autotune service, e.g. a node's store from before
the cluster shared one PostgreSQL database. Needs only Python 3.9+ (standard library):

    python3 docker/publish_results.py old-store/autotune.db http://localhost:8000

Each stored result is sent to URL/v1/results (what `autotune probe --publish` does), oldest
first, with `Authorization: Bearer $AUTOTUNE_TOKEN` when that variable is set. The service
checks it as it checks any published result: one it refuses (a workload it does not register,
say) is reported and skipped. Publishing the same file twice stores nothing new, but the result
published last answers a query: run it before new probes of the same workloads. Jobs and trials
are not carried over. Exit status: 0 when every result was stored, 1 when some were refused,
2 when the file or the service cannot be used.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import urllib.error
import urllib.request
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path, help="the SQLite store (AUTOTUNE_DB of the server that wrote it)")
    parser.add_argument("url", help="the service to publish to, e.g. http://localhost:8000")
    args = parser.parse_args(argv)
    token = os.environ.get("AUTOTUNE_TOKEN")

    try:
        documents = _documents(args.db)
    except (OSError, sqlite3.Error) as exc:
        print(f"cannot read {args.db}: {exc}", file=sys.stderr)
        return 2
    refused = 0
    for fingerprint, document in documents:
        try:
            _publish(args.url, document, token)
        except urllib.error.HTTPError as exc:
            reason = _detail(exc)
            if exc.code in (401, 403):
                print(f"{args.url} refused the token ({exc.code}): {reason}; set AUTOTUNE_TOKEN", file=sys.stderr)
                return 2
            print(f"{fingerprint[:16]}: refused ({exc.code}): {reason}", file=sys.stderr)
            refused += 1
        except (OSError, ValueError) as exc:  # URLError, connection refused, a malformed URL
            print(f"cannot reach {args.url}: {exc}", file=sys.stderr)
            return 2
    print(f"published {len(documents) - refused} of {len(documents)} results from {args.db} to {args.url}")
    return 1 if refused else 0


def _documents(db: Path) -> list[tuple[str, str]]:
    """(fingerprint, result document) for every stored result, oldest first."""
    if not db.is_file():
        raise FileNotFoundError(f"no such file (copy the store's directory, with any -wal file beside it): {db}")
    conn = sqlite3.connect(db)  # not read-only: SQLite may need to replay a -wal file left beside it
    try:
        rows = conn.execute("SELECT fingerprint, document FROM results ORDER BY stored_at, fingerprint").fetchall()
    finally:
        conn.close()
    return [(str(fingerprint), str(document)) for fingerprint, document in rows]


def _publish(url: str, document: str, token: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        url.rstrip("/") + "/v1/results", data=document.encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def _detail(error: urllib.error.HTTPError) -> str:
    body = error.read().decode(errors="replace")
    try:
        detail = json.loads(body).get("detail", body)
    except (ValueError, AttributeError):
        detail = body
    return detail if isinstance(detail, str) else json.dumps(detail)


if __name__ == "__main__":
    sys.exit(main())
