"""Start and stop a real Prometheus server (Debian's ``prometheus`` package, scripts/sysdeps.sh).

The server runs from KVFleet's shipped configuration, ``deploy/prometheus/prometheus.yml`` (its recording
and alert rules included), with three things set for this fleet: the control plane's service-discovery URL,
the file holding the token it is read with, and the scrape interval. It listens on a free loopback port
and keeps its data in a folder of its own, so a restart (``start(same_port=True)``) continues the same
series. Used by the tests, ``make demo`` (deploy/localfleet.py) and docker-compose.yml's command line::

    with PrometheusServer(sd_url=f"{cp}/api/v1/telemetry/targets/", sd_token=token) as prom:
        settings.PROMETHEUS_URL = prom.url

``python -m engine.fleet.prometheus --sd-url URL`` (the token in the file ``KVFLEET_SD_TOKEN_FILE`` names,
or in env ``KVFLEET_SD_TOKEN``) runs one in the foreground and prints its URL (docker-compose.yml).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

from engine.fleet.child import ChildServer
from engine.fleet.mooncake_master import HOST
from engine.ports import free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
CONFIG = DEPLOY / "prometheus.yml"
TOKEN_FILE = "kvfleet-sd-token"


class PrometheusError(RuntimeError):
    """The prometheus binary is missing, its configuration is refused, or it did not come up."""


def find_binary() -> str:
    """Path of ``prometheus`` on PATH; raises PrometheusError naming the Debian package when absent."""
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusError("prometheus not found: install the Debian package (scripts/sysdeps.sh)")
    return found


def _duration(seconds: float) -> str:
    """Prometheus' duration syntax (whole units only): milliseconds."""
    return f"{round(seconds * 1000)}ms"


def render_config(
    sd_url: str | None,
    token_file: str | None,
    scrape_interval_s: float,
    sd_refresh_s: float,
    evaluation_interval_s: float | None = None,
) -> dict:
    """The shipped configuration with this fleet's service-discovery URL, token file and intervals (s; the
    rules' evaluation interval defaults to the scrape interval).

    Rule files become absolute paths into ``deploy/prometheus/``. Without ``sd_url`` the server scrapes
    nothing (a reader-only server, e.g. for a test of the rules)."""
    config = yaml.safe_load(CONFIG.read_text())
    interval = _duration(scrape_interval_s)
    config["global"].update(
        scrape_interval=interval,
        evaluation_interval=_duration(evaluation_interval_s or scrape_interval_s),
        scrape_timeout=_duration(max(scrape_interval_s * 0.8, 0.5)),
    )
    config["rule_files"] = [str(DEPLOY / rule) for rule in config["rule_files"]]
    if sd_url is None:
        config["scrape_configs"] = []
        return config
    (sd,) = config["scrape_configs"][0]["http_sd_configs"]
    sd["url"] = sd_url
    sd["refresh_interval"] = _duration(sd_refresh_s)
    sd["authorization"]["credentials_file"] = token_file
    return config


class PrometheusServer(ChildServer):
    """One ``prometheus`` process on a free loopback port, scraping the targets the control plane's
    service discovery at ``sd_url`` lists (read with bearer ``sd_token``, kept in a 0600 file, never on a
    command line), every ``scrape_interval_s`` seconds; the target list is re-read every ``sd_refresh_s``.

    The server dies with the process (thread) that started it. ``start()`` raises
    :class:`PrometheusError` with the log tail when it is not ready within ``timeout`` seconds.
    """

    def __init__(
        self,
        *,
        sd_url: str | None = None,
        sd_token: str | None = None,
        scrape_interval_s: float = 5.0,
        sd_refresh_s: float = 5.0,
        evaluation_interval_s: float | None = None,
        data_dir: str | None = None,
        log_path: str | None = None,
        port: int = 0,
        listen_host: str = HOST,
    ) -> None:
        self.listen_host = listen_host
        self.scrape_interval_s = scrape_interval_s
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kvfleet-prometheus-"))
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path = log_path or str(self.data_dir / "prometheus.log")
        self.port = port
        self.process: subprocess.Popen | None = None
        token_file = None
        if sd_token is not None:
            token_file = str(self.data_dir / TOKEN_FILE)
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(sd_token)
        self.config_path = self.data_dir / "prometheus.yml"
        config = render_config(sd_url, token_file, scrape_interval_s, sd_refresh_s, evaluation_interval_s)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    @property
    def url(self) -> str:
        """Base URL of the HTTP API (``/api/v1/query`` etc.): the ``PROMETHEUS_URL`` setting."""
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 60.0, same_port: bool = False) -> PrometheusServer:
        """Start the server (a free port, or the previous one with ``same_port``: a restart, same data)."""
        if not same_port or not self.port:
            self.port = free_port()
        cmd = [
            find_binary(),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir / 'data'}",
            f"--web.listen-address={self.listen_host}:{self.port}",
            "--storage.tsdb.retention.time=2d",
            # a series with no scrape for 3 intervals is absent, not its last value carried on for Prometheus'
            # default 5 min: a dead worker or a TSDB outage is a gap on the charts, never a flat line
            f"--query.lookback-delta={_duration(max(3 * self.scrape_interval_s, 1.0))}",
            "--web.enable-lifecycle",
        ]
        self.spawn(cmd)
        if self.wait_ready(self._ready, timeout, poll_s=0.1):
            return self
        self.stop()
        raise PrometheusError(f"prometheus did not start; log {self.log_path}:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after ``timeout`` seconds); idempotent."""
        self.terminate(timeout)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run Prometheus with KVFleet's scrape config and rules.")
    parser.add_argument("--sd-url", required=True, help="the control plane's /api/v1/telemetry/targets/")
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="seconds between scrapes")
    parser.add_argument("--port", type=int, default=0, help="listen port (default: a free one)")
    parser.add_argument("--listen-host", default=HOST, help=f"listen address (default {HOST})")
    parser.add_argument("--data-dir", default=None, help="TSDB folder (default: a new temp folder)")
    args = parser.parse_args(argv)
    token_file = os.environ.get("KVFLEET_SD_TOKEN_FILE")
    token = Path(token_file).read_text().strip() if token_file else os.environ.get("KVFLEET_SD_TOKEN")
    if not token:
        parser.error("set KVFLEET_SD_TOKEN_FILE (or KVFLEET_SD_TOKEN): a viewer's token of the control plane")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = PrometheusServer(
        sd_url=args.sd_url,
        sd_token=token,
        scrape_interval_s=args.scrape_interval,
        data_dir=args.data_dir,
        port=args.port,
        listen_host=args.listen_host,
    )
    server.start(same_port=bool(args.port))
    print(f"PROMETHEUS_URL={server.url}", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:  # also on SIGTERM (SystemExit)
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
