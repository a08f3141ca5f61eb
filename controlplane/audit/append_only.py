"""Append-only audit rows, enforced by the database (migration 0002 installs the triggers).

PostgreSQL and SQLite both refuse any DELETE of an audit row and any UPDATE except the one the control plane
makes: a launch record's `outcome` set from `pending` to its final value, nothing else changed.

The one way around it is `set_purge_allowed(True)`, for the test runner's flush between transactional tests
only: on SQLite the delete trigger asks `kvfleet_audit_purge_allowed()`, a function registered on each Django
connection (a connection without it, e.g. the sqlite3 shell, can never delete); on PostgreSQL the flush is a
TRUNCATE, which row triggers do not see.
"""

_purge_allowed = False


def set_purge_allowed(allowed: bool) -> None:
    global _purge_allowed
    _purge_allowed = allowed


def register_sqlite_function(sender, connection, **kwargs) -> None:
    if connection.vendor == "sqlite":
        connection.connection.create_function(
            "kvfleet_audit_purge_allowed", 0, lambda: int(_purge_allowed), deterministic=False
        )
