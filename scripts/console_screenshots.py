"""Screenshot every console page at 1280 px in headless Chromium (Playwright), for docs/console.md.

    .venv/bin/python scripts/console_screenshots.py --url http://127.0.0.1:8000 --user admin --password ...
    .venv/bin/python scripts/console_screenshots.py --demo     # starts deploy/localfleet.py itself
    .venv/bin/python scripts/console_screenshots.py --demo --pd --only rebalance,prefill-worker   # PD pages

With --demo it starts the local fleet (control plane, Mooncake master, two SmolLM2 workers, the smg router,
traffic), runs one detach + attach operation so the operation and audit pages have content, waits until
the worker charts hold samples, then writes docs/console/<page>.png (full page; confirm.png is the launch
confirmation, cancelled; capacity.png after a what-if run on the page's defaults over the demo's recorded
traffic, or, without any, over a shared trace swept from the worker's L1 up) and stops the fleet.
Exits 1 naming the page when one fails to render.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def pages(api) -> list[tuple[str, str]]:
    """(name, path) of every page, with ids of real objects read from the API."""
    workers = api("GET", "/api/v1/inventory/workers/").json()["results"]
    hosts = api("GET", "/api/v1/inventory/hosts/").json()["results"]
    routers = api("GET", "/api/v1/inventory/routers/").json()["results"]
    ops = api("GET", "/api/v1/operations/").json()["results"]
    out = [("fleet", "/")]
    if workers:  # a worker with L3 attached shows every chart (a PD prefill worker has no latency charts)
        shown = next((w for w in workers if w["storage_backend"] and w["role"] != "prefill"), workers[0])
        out.append(("worker", f"/workers/{shown['id']}/"))
    prefill = [w for w in workers if w["role"] == "prefill"]
    if prefill:
        out.append(("prefill-worker", f"/workers/{prefill[0]['id']}/"))
    if hosts:
        out.append(("host", f"/hosts/{hosts[0]['id']}/"))
    if routers:
        out.append(("router", f"/routers/{routers[0]['id']}/"))
    pd = [r for r in routers if r["mode"] == "pd"]
    if pd:
        out.append(("rebalance", f"/routers/{pd[0]['id']}/rebalance/"))
    out += [("storage", "/storage/"), ("capacity", "/capacity/"), ("operations", "/operations/")]
    out.append(("launch", "/operations/new/"))
    if ops:
        out.append(("operation", f"/operations/{ops[0]['id']}/"))
    out.append(("audit", "/audit/"))
    return out


def run_whatif(page) -> None:
    """On the capacity page: run the what-if on the page's defaults when they replay a pool's recorded traffic
    (the demo records its own: an L1 sweep around the marked pool's L1, L1 alone); without recorded traffic,
    sweep L1 from the marked pool's current L1 up (L2, L3 fixed) over a shared trace, so the chart has every
    line and the current-capacity marker. Waits for the replay (up to 420 s)."""
    if not page.locator("#trace").input_value().startswith("pool:"):
        shared = page.locator("#trace option[value^='shared:synthetic']")
        if shared.count():
            page.locator("#trace").select_option(shared.first.get_attribute("value"))
        current = page.evaluate(
            "(() => { const f = document.querySelector('#whatif-form');"
            " const ws = JSON.parse(document.querySelector('#workers-data').textContent);"
            " const w = ws.find(x => x.pool === f.pool.value && x.l1_tokens);"
            " return w ? w.l1_tokens : 0; })()"
        )
        sweep = (current or 1024, 250_000, 500_000, 1_000_000)  # below L2: the engine needs L2 > L1
        page.get_by_label("L1 tokens").fill(",".join(map(str, sweep)))
        page.get_by_label("L2 tokens").fill("2000000")
        page.get_by_label("L3 tokens").fill("16000000")  # three tiers, three lines apart
    page.get_by_role("button", name="Run").click()
    page.wait_for_function(
        "/points$/.test(document.querySelector('#whatif-status').textContent)"
        " || document.querySelector('#whatif-error').textContent",
        timeout=420_000,
    )
    error = page.locator("#whatif-error").inner_text()
    if error:
        raise SystemExit(f"capacity: the what-if failed: {error}")


def shoot(
    base: str, user: str, password: str, api, out_dir: Path, settle_s: float = 1.5, only: str | None = None
) -> list[Path]:
    """Log in and write ``out_dir/<page>.png`` for every page (``only``: a comma list of page names)."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(30000)
        page.on(
            "pageerror",
            lambda exc: print(f"page error on {page.url}: {exc}\n{exc.stack}", file=sys.stderr, flush=True),
        )
        page.on(
            "console",
            lambda m: m.type == "error" and print(f"console: {m.text}", file=sys.stderr, flush=True),
        )
        page.goto(base + "/login/")
        page.screenshot(path=str(out_dir / "login.png"))
        written.append(out_dir / "login.png")
        page.get_by_label("Username").fill(user)
        page.get_by_label("Password").fill(password)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(base + "/")
        wanted = set(only.split(",")) if only else None
        for name, path in pages(api):
            if wanted and name not in wanted:
                continue
            page.goto(base + path)
            if name == "capacity":  # its calibration replays the recorded traffic: minutes on a busy machine
                page.wait_for_selector("body[data-loaded='1']")
                page.wait_for_function(
                    "!/^Replaying/.test(document.querySelector('[data-testid=calibration-text]').textContent)",
                    timeout=300_000,
                )
                run_whatif(page)
            else:
                page.wait_for_load_state("networkidle")
                page.wait_for_selector("body[data-loaded='1']")
            time.sleep(
                settle_s
            )  # let a websocket push or two arrive so live values show, as a user sees them
            target = out_dir / f"{name}.png"
            page.screenshot(path=str(target), full_page=True)
            width = page.evaluate("document.documentElement.scrollWidth")
            print(f"{name:12s} {path:24s} scrollWidth={width}px -> {target}", flush=True)
            written.append(target)
        workers = api("GET", "/api/v1/inventory/workers/").json()["count"]
        if workers and (not wanted or "confirm" in wanted):  # the launch confirmation, cancelled
            page.goto(base + "/operations/new/")
            page.wait_for_selector("body[data-loaded='1']")
            page.locator("#select-all").check()
            page.get_by_label("Reason (kept in the audit log and on the operation)").fill("docs screenshot")
            page.get_by_role("button", name="Review and launch").click()
            page.wait_for_selector("#confirm[open]")
            page.screenshot(path=str(out_dir / "confirm.png"))
            written.append(out_dir / "confirm.png")
            page.locator("#confirm-cancel").click()
        browser.close()
    return written


def demo_operations(fleet) -> None:
    """Detach then re-attach worker 0's L3 so the operation and audit pages show real changes."""
    workers = fleet.api("GET", "/api/v1/inventory/workers/").json()["results"]
    profile = fleet.api("GET", "/api/v1/inventory/storage-profiles/").json()["results"][0]
    for kind, extra in (("detach", {}), ("attach", {"storage_profile": profile["id"]})):
        body = {"kind": kind, "workers": [workers[0]["id"]], "reason": f"docs screenshot: {kind} L3", **extra}
        op = fleet.api("POST", "/api/v1/operations/", json=body).json()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            state = fleet.api("GET", f"/api/v1/operations/{op['id']}/").json()["state"]
            if state != "running":
                break
            time.sleep(1)


def _interrupt(*_) -> None:
    """SIGTERM as Ctrl-C: the fleet's processes (each in a session of its own) are stopped too."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="console base URL of a running control plane")
    p.add_argument("--user", default="admin")
    p.add_argument("--password")
    p.add_argument("--token", help="API token (admin) used to find object ids")
    p.add_argument("--demo", action="store_true", help="start deploy/localfleet.py and shoot it")
    p.add_argument("--pd", action="store_true", help="--demo: the PD fleet (deploy/fleet.pd.toml)")
    p.add_argument("--only", help="shoot only these pages, a comma list (e.g. rebalance,prefill-worker)")
    p.add_argument("--warmup", type=float, default=60, help="--demo: seconds of traffic before shooting")
    p.add_argument("--out", default=str(REPO / "docs" / "console"))
    a = p.parse_args(argv)
    import httpx

    if a.demo:
        from deploy.localfleet import PY, LocalFleet

        fleet = LocalFleet(log_dir=REPO / "logs" / time.strftime("screens-%Y%m%d-%H%M%S"), pd=a.pd)
        signal.signal(signal.SIGTERM, _interrupt)
        with fleet:
            traffic = ["--url", fleet.router_url, "--concurrency", "2", "--conversations", "8"]
            fleet.spawn("traffic", [PY, "-m", "engine.bench.traffic", *traffic])
            if not a.pd:
                demo_operations(fleet)
            time.sleep(a.warmup)
            shoot(
                fleet.console_url, fleet.admin_user, fleet.admin_password, fleet.api, Path(a.out), only=a.only
            )
        return 0
    if not (a.url and a.password and a.token):
        p.error("--url, --password and --token are required without --demo")

    def api(method: str, path: str, **kw):
        return httpx.request(method, a.url + path, headers={"Authorization": f"Bearer {a.token}"}, **kw)

    shoot(a.url, a.user, a.password, api, Path(a.out), only=a.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
