"""``manage.py bootstrap``: the first admin and an agent token, tokens only in 0600 files, never printed."""

import io
import json
import stat

import pytest
from django.core.management import CommandError, call_command

from controlplane.accounts.models import ApiToken
from controlplane.accounts.selectors import token_get_by_plaintext, user_role

pytestmark = pytest.mark.django_db


def test_creates_the_admin_and_an_agent_token_bound_to_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_ADMIN_PASSWORD", "a-long-demo-password")
    tokens_file, agent_file = tmp_path / "secrets" / "tokens.json", tmp_path / "agent.token"
    out = io.StringIO()
    call_command(
        "bootstrap", "--agent-host=gpu-1", f"--tokens-file={tokens_file}", f"--agent-token-file={agent_file}",
        stdout=out,
    )  # fmt: skip
    tokens = json.loads(tokens_file.read_text())
    assert stat.S_IMODE(tokens_file.stat().st_mode) == 0o600
    assert (
        stat.S_IMODE(agent_file.stat().st_mode) == 0o600 and agent_file.read_text().strip() == tokens["agent"]
    )
    admin, agent = token_get_by_plaintext(tokens["admin"]), token_get_by_plaintext(tokens["agent"])
    assert (
        user_role(admin.user),
        admin.user.username,
        admin.user.check_password("a-long-demo-password"),
    ) == (
        "admin",
        "admin",
        True,
    )
    assert (user_role(agent.user), agent.host_name) == ("agent", "gpu-1")
    assert tokens["admin"] not in out.getvalue() and "ready" in out.getvalue()
    # a second run keeps the agent token its engine host already holds
    call_command("bootstrap", "--agent-host=gpu-1", f"--agent-token-file={agent_file}", stdout=io.StringIO())
    assert ApiToken.objects.filter(user=agent.user).count() == 1


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--agent-host=gpu-1"], "--admin-password (or KVFLEET_ADMIN_PASSWORD)"),
        (["--admin-password=pw"], "--agent-host (or KVFLEET_HOST_NAME)"),
    ],
)
def test_a_missing_password_or_host_names_the_flag_and_creates_nothing(monkeypatch, argv, flag):
    monkeypatch.delenv("KVFLEET_ADMIN_PASSWORD", raising=False)
    monkeypatch.delenv("KVFLEET_HOST_NAME", raising=False)
    with pytest.raises(CommandError, match=flag.replace("(", r"\(").replace(")", r"\)")):
        call_command("bootstrap", *argv)
    assert not ApiToken.objects.exists()
