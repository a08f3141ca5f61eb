"""Browser tests run against the control plane's fixtures (daphne, personas with real tokens, fake workers
and routers, a real Celery worker): the same conftest, loaded once."""

from tests.controlplane.conftest import *  # noqa: F403
