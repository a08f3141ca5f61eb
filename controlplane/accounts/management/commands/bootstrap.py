"""``manage.py bootstrap``: the first admin and an agent API token (run after ``manage.py migrate``).

``manage.py bootstrap --admin-user admin --agent-host NAME [--agent-token-file PATH] [--tokens-file PATH]``
with the password in ``KVFLEET_ADMIN_PASSWORD`` (or ``--admin-password``) creates (or resets the password
of) the admin user and an ``agent`` user and issues one API token for each (the agent's bound to host NAME,
the spec's ``host_name``: it may register only that host). ``--tokens-file`` writes them there as JSON
(``{"admin": "cp_...", "agent": "cp_..."}``, mode 0600, in a folder made 0700 when new); tokens are never
printed (stdout is often captured into a log). With ``--agent-token-file`` the agent token is also written
there (mode 0600) for the engine host to read, and no new agent token is issued when the file already
exists. With ``--prometheus-token-file`` (env ``KVFLEET_PROMETHEUS_TOKEN_FILE``) a ``prometheus`` viewer
user gets a token too, written there once (mode 0600): the TSDB reads the service-discovery endpoint with
it (read-only; deploy/prometheus/prometheus.yml). Every write goes through the accounts services, so it is
audited. A missing password or host is a
CommandError (exit 2) naming the flag and its variable.
"""

import json
import os
import secrets
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts.services import token_create, user_create


def write_secret_file(path: str, text: str) -> None:
    """Write ``text`` to ``path``, owner-only (0600 also when it existed; a new parent folder 0700)."""
    Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def bootstrap(
    admin_user: str,
    admin_password: str,
    label: str,
    agent_token_file: str | None,
    agent_host: str,
    prometheus_token_file: str | None = None,
) -> dict:
    """The admin and agent users and their new tokens: {"admin": "cp_...", "agent": "cp_..."}; with
    ``prometheus_token_file`` also a ``prometheus`` viewer's ("prometheus": "cp_...")."""
    users = get_user_model().objects
    out = {}
    accounts = [(admin_user, "admin", admin_password), ("agent", "agent", None)]
    if prometheus_token_file:
        accounts.append(("prometheus", "viewer", None))
    for username, role, password in accounts:
        user = users.filter(username=username).first()
        if user is None:
            user = user_create(username=username, password=password or secrets.token_urlsafe(24), role=role,
                               actor=None)  # fmt: skip
        elif password:
            user.set_password(password)
            user.save()
        key = "prometheus" if username == "prometheus" else role
        kept = {"agent": agent_token_file, "prometheus": prometheus_token_file}.get(key)
        if kept and Path(kept).exists():
            out[key] = Path(kept).read_text().strip()
            continue
        host = agent_host if role == "agent" else ""
        out[key] = token_create(user=user, name=f"{key} token ({label})", actor=None, host=host)[1]
    for key, path in (("agent", agent_token_file), ("prometheus", prometheus_token_file)):
        if path and not Path(path).exists():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(out[key] + "\n")
    return out


class Command(BaseCommand):
    help = "Create the first admin and an agent API token (after migrate); tokens are never printed."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--admin-user", default=os.environ.get("KVFLEET_ADMIN_USER", "admin"))
        parser.add_argument(
            "--admin-password",
            default=os.environ.get("KVFLEET_ADMIN_PASSWORD"),
            help="prefer env KVFLEET_ADMIN_PASSWORD: a command line is visible to every user of the host",
        )
        parser.add_argument("--label", default="bootstrap", help="suffix of the token names")
        parser.add_argument("--agent-token-file", default=os.environ.get("KVFLEET_AGENT_TOKEN_FILE"))
        parser.add_argument(
            "--agent-host",
            default=os.environ.get("KVFLEET_HOST_NAME"),
            help="the host the agent token may register (its spec's host_name; env KVFLEET_HOST_NAME)",
        )
        parser.add_argument(
            "--prometheus-token-file",
            default=os.environ.get("KVFLEET_PROMETHEUS_TOKEN_FILE"),
            help="also issue a token to a 'prometheus' viewer (the TSDB's service discovery), written here",
        )
        parser.add_argument(
            "--tokens-file", default=None, help="write the new tokens there as JSON (mode 0600)"
        )

    def handle(self, *args, **o) -> None:
        if not o["admin_password"]:
            raise CommandError("--admin-password (or KVFLEET_ADMIN_PASSWORD) is required", returncode=2)
        if not o["agent_host"]:
            raise CommandError("--agent-host (or KVFLEET_HOST_NAME) is required", returncode=2)
        tokens = bootstrap(
            o["admin_user"],
            o["admin_password"],
            o["label"],
            o["agent_token_file"],
            o["agent_host"],
            o["prometheus_token_file"],
        )
        if o["tokens_file"]:
            write_secret_file(o["tokens_file"], json.dumps(tokens))
        where = [f"; agent token in {o['agent_token_file']}"] if o["agent_token_file"] else []
        where += [f"; prometheus token in {o['prometheus_token_file']}"] if o["prometheus_token_file"] else []
        where += [f"; tokens in {o['tokens_file']}"] if o["tokens_file"] else []
        issued, where_text = " and ".join(tokens), "".join(where)
        self.stdout.write(f"admin user {o['admin_user']!r} ready, API tokens issued for {issued}{where_text}")
