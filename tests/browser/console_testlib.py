"""Helpers of the browser tests: a console user, logging in at 1280 px, axe-core's serious violations. Most
tests take the ``console_page`` fixture (tests/browser/conftest.py) instead: user, Chromium and log-in in
one call."""

from pathlib import Path

from django.contrib.auth.hashers import make_password

AXE = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"
CHROMIUM = "/usr/bin/chromium"  # the Debian package (scripts/sysdeps.sh)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "pw-for-tests-1"


def console_user(username: str, role: str, password: str = PASSWORD):
    """A console user with `role` who logs in with `password` (hashed with pbkdf2, the daphne process's
    hasher: the test settings' fast hasher is not the server's)."""
    from cp_factories import UserFactory  # registered by tests/controlplane/conftest.py

    user = UserFactory(username=username, role=role)
    user.password = make_password(password, hasher="pbkdf2_sha256")
    user.save()
    return user


def log_in(browser, base_url: str, username: str, password: str = PASSWORD, *, height: int = 800):
    """A 1280 px wide page (``height`` tall) of `browser` logged in to the console at `base_url` as
    `username`; returns the page and the list its uncaught page errors are appended to."""
    page = browser.new_page(viewport={"width": 1280, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base_url + "/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    return page, errors


def serious_violations(page) -> list[str]:
    """axe-core's WCAG 2 A/AA rules on the current page: 'rule (impact): first target' per serious one."""
    page.add_script_tag(path=str(AXE))
    result = page.evaluate(
        "axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21aa']}})"
    )
    return [
        f"{v['id']} ({v['impact']}): {v['nodes'][0]['target']}"
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]


def wrapped(page, selector: str) -> list[str]:
    """The visible elements matching ``selector`` whose text takes more than one line, as 'tag: text': a
    name, tile label or time an operator would read split at 1280 px."""
    return page.evaluate(
        """(selector) => [...document.querySelectorAll(selector)].filter(el => {
          if (!el.getClientRects().length) return false;
          const range = document.createRange();
          range.selectNodeContents(el);
          const rects = [...range.getClientRects()].filter(r => r.width > 0);
          const bottoms = rects.map(r => r.bottom).sort((a, b) => a - b);
          return bottoms.filter((b, i) => i === 0 || b - bottoms[i - 1] > 8).length > 1;
        }).map(el => el.tagName.toLowerCase() + ': ' + el.textContent.trim())""",
        selector,
    )
