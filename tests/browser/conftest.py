"""Browser tests run against the control plane's fixtures (daphne, personas with real tokens, fake workers
and routers, a real Celery worker): the same conftest, loaded once. ``import *`` leaves out underscored
names, so the autouse fixtures (fresh telemetry keys per test, Playwright's longer expect timeout) are
imported by name."""

from tests.controlplane.conftest import *  # noqa: F403
from tests.controlplane.conftest import _browser_expect_timeout, _fresh_telemetry_keys  # noqa: F401
