"""Create the first admin and an agent API token in the control plane (run after ``manage.py migrate``).

``python deploy/bootstrap.py --admin-user admin --admin-password PW --agent-host NAME [--agent-token-file
PATH]`` creates (or resets the password of) the admin user and an ``agent`` user and issues one API token for
each (the agent's bound to host NAME, the spec's ``host_name``: it may register only that host);
``--tokens-file PATH`` writes them there as JSON (``{"admin": "cp_...", "agent": "cp_..."}``, mode 0600, in a
folder made 0700 when new); tokens are never printed (stdout is often captured into a log). With
``--agent-token-file`` the agent token is also written there (mode 0600) for the engine host to read, and
no new agent token is issued when the file already exists. Uses the control plane's own services, so
every write is audited.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bootstrap(
    admin_user: str, admin_password: str, label: str, agent_token_file: str | None, agent_host: str
) -> dict:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    django.setup()
    from django.contrib.auth import get_user_model

    from controlplane.accounts.services import token_create, user_create

    users = get_user_model().objects
    out = {}
    for username, role, password in ((admin_user, "admin", admin_password), ("agent", "agent", None)):
        user = users.filter(username=username).first()
        if user is None:
            user = user_create(username=username, password=password or secrets.token_urlsafe(24), role=role,
                               actor=None)  # fmt: skip
        elif password:
            user.set_password(password)
            user.save()
        if role == "agent" and agent_token_file and Path(agent_token_file).exists():
            out[role] = Path(agent_token_file).read_text().strip()
            continue
        host = agent_host if role == "agent" else ""
        out[role] = token_create(user=user, name=f"{role} token ({label})", actor=None, host=host)[1]
    if agent_token_file and not Path(agent_token_file).exists():
        Path(agent_token_file).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(agent_token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(out["agent"] + "\n")
    return out


def write_secret_file(path: str, text: str) -> None:
    """Write ``text`` to ``path``, owner-only (0600 also when it existed; a new parent folder 0700)."""
    Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/bootstrap.py", description=__doc__.split("\n")[0])
    p.add_argument("--admin-user", default=os.environ.get("KVFLEET_ADMIN_USER", "admin"))
    p.add_argument("--admin-password", default=os.environ.get("KVFLEET_ADMIN_PASSWORD"))
    p.add_argument("--label", default="bootstrap", help="suffix of the token names")
    p.add_argument("--agent-token-file", default=os.environ.get("KVFLEET_AGENT_TOKEN_FILE"))
    p.add_argument(
        "--agent-host",
        default=os.environ.get("KVFLEET_HOST_NAME"),
        help="the host the agent token may register (its spec's host_name; env KVFLEET_HOST_NAME)",
    )
    p.add_argument("--tokens-file", default=None, help="write the new tokens there as JSON (mode 0600)")
    a = p.parse_args(argv)
    if not a.admin_password:
        print(
            "deploy/bootstrap.py: error: --admin-password (or KVFLEET_ADMIN_PASSWORD) is required",
            file=sys.stderr,
        )
        return 2
    if not a.agent_host:
        print("deploy/bootstrap.py: error: --agent-host (or KVFLEET_HOST_NAME) is required", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    tokens = bootstrap(a.admin_user, a.admin_password, a.label, a.agent_token_file, a.agent_host)
    if a.tokens_file:
        write_secret_file(a.tokens_file, json.dumps(tokens))
    where = [f"; agent token in {a.agent_token_file}"] if a.agent_token_file else []
    where += [f"; tokens in {a.tokens_file}"] if a.tokens_file else []
    print(f"admin user {a.admin_user!r} ready, API tokens issued for admin and agent{''.join(where)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
