"""Capacity page in real headless Chromium against daphne: a what-if sweep over a pool's recorded traffic
(replayed by the engine's CLI, at the page size of the pool it is asked about) is plotted with the pool's
current L1 marked (the default L1 sweep is around it), and the sizing calculator starts from the worker's
reported numbers. The docs' screenshot (docs/console/capacity.png) is the demo's:
scripts/console_screenshots.py."""

import re
import time

import httpx
import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _scraped(tsdb, gauges: dict[str, dict[str, float]]) -> None:
    """The TSDB holds one scrape of each worker (by name) exporting these gauges (SGLang's names), now."""
    now = time.time()
    texts = {name: "".join(f"sglang:{k} {v}\n" for k, v in g.items()) for name, g in gauges.items()}
    tsdb.serve([(name, now, text) for name, text in texts.items()])


def test_capacity_page_sweep_marker_and_sizing(
    tsdb, asgi_server, console_page, personas, tmp_path, fake_worker
):
    from playwright.sync_api import expect

    live = fake_worker(kv_bytes_per_token=46_080)  # what the demo's SmolLM2 worker answers at /get_model_info
    worker = EngineWorkerFactory(
        name="gpu-0", url=live.url, host=HostFactory(name=AGENT_HOST), page_size=16, role="mixed"
    )
    EngineWorkerFactory(name="gpu-1", page_size=64, role="decode")
    agent = {"Authorization": f"Bearer {personas['agent'][1]}"}
    _scraped(tsdb, {worker.name: {"max_total_num_tokens": 2048, "hicache_host_total_tokens": 4112}})
    # Four 1,030-token prompts (two whole blocks + 6 tokens), each asked twice in a row, then all four again:
    # a hit is the 1,024 tokens of whole 16-token pages in input[:-1]. With 2,048 L1 tokens only the
    # back-to-back repeats hit (4 hits); with 8,192 the second round hits too (8).
    order = [1, 1, 2, 2, 3, 3, 4, 4, 1, 2, 3, 4]
    ids = [[10 * p, 10 * p + 1, 10 * p + 2] for p in order]
    rows = [
        {"timestamp": i, "input_length": 1030, "output_length": 4, "hash_ids": h} for i, h in enumerate(ids)
    ]
    httpx.post(f"{asgi_server}/api/v1/agent/traces/", json={"worker_url": worker.url, "requests": rows},
               headers=agent).raise_for_status()  # fmt: skip

    page, errors = console_page("bob", "viewer")
    page.set_default_timeout(60000)
    page.get_by_role("link", name="Capacity").click()
    # The sizing calculator is filled from gpu-0's report: page 16, L1 2,048, L2 4,112 (ratio 2).
    expect(page.locator("#sizing-table tbody tr").first).to_contain_text("2,048")
    # bytes per token is the worker's own (/get_model_info), not a template constant
    expect(page.locator("#sizing-form").get_by_label("KV bytes per token")).to_have_value("46080")
    expect(page.get_by_test_id("bytes-source")).to_have_text("from gpu-0's /get_model_info")
    expect(page.locator("#sizing-table tbody tr").first.locator("td").nth(2)).to_have_text("90 MiB")
    l2_row = page.locator("#sizing-table tbody tr").nth(1).locator("td")
    assert [l2_row.nth(i).inner_text() for i in (1, 3)] == ["4,112", "4,112"]  # computed = reported
    # The replay's page size is the marked pool's workers': regular 16, decode 64; choosing a pool's
    # traffic marks that pool.
    page_size = page.locator("#whatif-form").get_by_label("Page size")
    expect(page_size).to_have_value("16")
    expect(page.locator("#trace")).to_have_value("pool:regular")  # the marked pool's own traffic
    # The L1 sweep starts at the marked pool's live L1 (gpu-0's 2,048 tokens), then goes around it, and
    # says so; the decode pool has no reporting worker, so its sweep is gpu-0's too, in 64-token pages.
    l1 = page.get_by_label("L1 tokens")
    expect(l1).to_have_value("2048,512,1024,4096,8192,16384,32768")
    expect(page.get_by_test_id("l1-source")).to_have_text(
        "Default: the live L1 pool of gpu-0 first (2,048 tokens, from its metrics), then 0.25× to 16× it"
    )
    # L2 follows each L1 point by gpu-0's ratio ((4,112 - 16) / 2,048 = 2), as the engine sizes it.
    expect(page.get_by_label("L2 tokens", exact=True)).to_have_value("")
    expect(page.get_by_label("or L2 = --hicache-ratio × each L1")).to_have_value("2")
    expect(page.get_by_label("L3 tokens")).to_have_value("0")
    expect(page.get_by_test_id("upper-source")).to_have_text(
        "Default: gpu-0 reports 4,112 L2 tokens (--hicache-ratio 2 × its 2,048 L1 tokens, plus the one "
        "16-token page the engine adds: L2 follows each L1 point) and no L3 backend"
    )
    # The recorded rows predate any metrics sample: there is no window to calibrate over, and it says so.
    expect(page.get_by_test_id("calibration-text")).to_have_text(
        "No calibration: no worker of the pool has metrics samples covering its recorded traffic."
    )
    # Before the first Run the chart card says what to do, and the results table is hidden.
    expect(page.get_by_test_id("whatif-empty")).to_contain_text("Press Run to replay the trace")
    expect(page.locator("#whatif-table")).to_be_hidden()
    page.screenshot(path=str(tmp_path / "capacity-before-run.png"), full_page=True)
    page.locator("#whatif-form").get_by_label("Pool marked as current").select_option("decode")
    expect(page_size).to_have_value("64")
    expect(page.get_by_test_id("l1-source")).to_contain_text("gpu-0 (no decode worker has reported one)")
    expect(page.get_by_label("L2 tokens", exact=True)).to_have_value("0")
    expect(page.get_by_test_id("upper-source")).to_have_text(
        "Default: no decode worker has reported yet: 0 (no tier)"
    )
    page.locator("#trace").select_option("pool:regular")
    expect(page.locator("#whatif-form select[name=pool]")).to_have_value("regular")
    # the calibration card follows the pool the trace chose (it kept saying "pool decode")
    expect(page.get_by_test_id("calibration-text")).to_have_text(
        "No calibration: no worker of the pool has metrics samples covering its recorded traffic."
    )
    expect(page_size).to_have_value("16")
    expect(l1).to_have_value("2048,512,1024,4096,8192,16384,32768")
    page.get_by_role("button", name="Run").click()  # the defaults as they are: the marker is on the chart
    # while the replays run the status counts the seconds so far
    expect(page.locator("#whatif-status")).to_have_text(re.compile(r"^Replaying… \d+ s$"))
    # L2 follows L1 by the ratio: every default point is one the engine runs, none skipped
    expect(page.locator("#whatif-status")).to_have_text("7 points", timeout=180_000)
    expect(page.get_by_test_id("whatif-empty")).to_be_hidden()
    expect(page.locator("#whatif-table tbody tr")).to_have_count(7)
    _the_live_point_first_and_a_refusing_one_named(page, expect)
    page.screenshot(path=str(tmp_path / "capacity-after-run.png"), full_page=True)
    assert page.locator("#whatif-chart").get_attribute("data-marked") == "2048"
    expect(page.locator("#whatif-chart canvas")).to_have_count(1)
    # 512 to 32768 (x64) on a log axis: the points spread over the chart, not into its first tenth
    assert page.locator("#whatif-chart").get_attribute("data-x-scale") == "log2"
    page.get_by_label("L1 tokens").fill("2048,8192")
    page.get_by_label("L2 tokens", exact=True).fill("0")  # L1 only
    page.get_by_label("or L2 = --hicache-ratio × each L1").fill("")
    page.get_by_role("button", name="Run").click()
    expect(page.locator("#whatif-status")).to_have_text(
        "2 points", timeout=180_000
    )  # a child process replays
    expect(page.locator("#whatif-table tbody tr")).to_have_count(2)
    total = 12 * 1030
    cells = [page.locator("#whatif-table tbody tr").nth(i).locator("td").nth(7).inner_text() for i in (0, 1)]
    assert cells == [_pct(4 * 1024 / total), _pct(8 * 1024 / total)]  # as the console shows shares
    assert page.locator("#whatif-chart").get_attribute("data-marked") == "2048"
    assert page.locator("#whatif-chart").get_attribute("data-x-scale") == "linear"  # x4: linear reads fine
    _ceiling_at_the_largest_point(page, expect, total)
    # the legend shows the largest capacity's shares (not dashes) while the cursor is off the plot
    legend = page.locator("#whatif-chart .u-legend .u-series", has_text="L1 + L2 + L3")
    expect(legend).to_contain_text(cells[1])
    expect(page.locator("#whatif-chart .u-legend .u-series").first).to_contain_text("8,192")
    # a sweep point the engine could not run (L2 not larger than L1) is left out and named
    page.get_by_label("L2 tokens", exact=True).fill("4096")
    page.get_by_role("button", name="Run").click()
    expect(page.locator("#whatif-status")).to_have_text(
        "1 point; skipped points: L1 8192 / L2 4096 / L3 0: L2 must be larger than L1", timeout=180_000
    )
    expect(page.locator("#whatif-table tbody tr")).to_have_count(1)
    expect(page.locator("#whatif-chart canvas")).to_have_count(1)
    _gap_to_the_ceiling_under_fifo(page, expect, total)
    page.screenshot(path=str(tmp_path / "capacity-gap-split.png"), full_page=True)
    assert serious_violations(page) == []
    assert errors == []


def _the_live_point_first_and_a_refusing_one_named(page, expect) -> None:
    """The live configuration is the first row; 512 L1 tokens hold none of the 1,030-token prompts, and
    that row says so rather than passing for a measured share."""
    first = page.locator("#whatif-table tbody tr").first.locator("td")
    assert [first.nth(i).inner_text() for i in (0, 1, 2)] == ["live configuration", "2,048", "4,112"]
    expect(page.locator("#whatif-table tbody tr").nth(1).locator("td").first).to_have_text(
        "12 of 12 requests do not fit in L1 (the engine refuses them)"
    )


def _ceiling_at_the_largest_point(page, expect, total: int) -> None:
    """Each prompt's repeats (what an unbounded cache serves) are all served at L1 8,192: the page says
    capacity no longer limits this traffic."""
    ceiling = _pct(8 * 1024 / total)
    expect(page.get_by_test_id("whatif-ceiling")).to_have_text(
        f"Ceiling: {ceiling} of input tokens repeat at all, what an unbounded cache would serve. "
        f"The best point here serves {ceiling}: at the ceiling, so more capacity or another policy "
        "cannot raise it; only more reuse in the traffic can."
    )


def _gap_to_the_ceiling_under_fifo(page, expect, total: int) -> None:
    """L1 2,048 alone under fifo: half the repeats are lost to capacity, and the gap is named."""
    page.get_by_label("L1 tokens").fill("2048")
    page.get_by_label("L2 tokens", exact=True).fill("0")
    page.locator("#whatif-form").get_by_label("Eviction").select_option("fifo")
    page.get_by_role("button", name="Run").click()
    expect(page.locator("#whatif-status")).to_have_text("1 point", timeout=180_000)
    served, gap = _pct(4 * 1024 / total), 100 * 4 * 1024 / total
    expect(page.get_by_test_id("whatif-ceiling")).to_contain_text(
        f"serves {served}, {gap:.1f} points below: that much is lost to capacity or the fifo policy."
    )
    # One 1,030-token prompt and the next one's 65 pages do not fit in 128 pages together: Belady's MIN
    # keeps only the back-to-back repeats too, so the whole gap is capacity, none of it the policy's.
    expect(page.get_by_test_id("whatif-ceiling")).to_contain_text(
        f"Of it, {gap:.1f} pts no eviction policy keeps at that capacity (Belady's MIN, the offline "
        f"optimum, serves {served}) and 0.0 pts a better policy would keep."
    )
    row = page.locator("#whatif-table tbody tr").first.locator("td")
    assert [row.nth(i).inner_text() for i in (8, 9, 10)] == [served, "0.0 pts", f"{gap:.1f} pts"]
    expect(page.locator("#whatif-chart .u-legend")).to_contain_text("optimum (Belady's MIN, all tiers)")


def _pct(share: float) -> str:
    """A share as KV.units["%"] writes it: "33.1 %" (one decimal, none when whole)."""
    return f"{round(100 * share, 1):g} %"


def test_capacity_page_shows_the_tokens_each_kv_dtype_fits_per_rank(
    tsdb, asgi_server, console_page, personas, tmp_path, fake_worker
):
    """The demo's SmolLM2 worker (float32 KV, 46,080 bytes per token, L1 2,048 / L2 4,112 tokens): at the
    same memory bfloat16 fits 4,096 / 8,224 tokens per rank (2×), fp8 8,192 / 16,448 (4×), int8 (its
    scales make 11,880 bytes) 7,936 / 15,936 (3.88×); a worker that reports no host pool shows "—" for L2
    with the reason, one that does not answer /get_model_info says so."""
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    gauges = {}
    for name, l2 in (("cpu-0", 4112), ("cpu-1", None)):
        live = fake_worker(kv_bytes_per_token=46_080)
        EngineWorkerFactory(name=name, url=live.url, host=host, page_size=16, role="mixed")
        gauges[name] = {"max_total_num_tokens": 2048, **({"hicache_host_total_tokens": l2} if l2 else {})}
    _scraped(tsdb, gauges)
    EngineWorkerFactory(name="gone-0", host=host, role="mixed")  # answers nothing

    page, errors = console_page("bob", "viewer", height=900)
    page.goto(asgi_server + "/capacity/")
    table = page.locator("#kv-dtype-table")

    def cells(worker, dtype):
        row = table.locator(f"tr[data-worker='{worker}'][data-dtype='{dtype}']")
        return [
            row.locator(f"[data-f={f}]").inner_text()
            for f in ("bytes_per_token", "l1_tokens", "l2_tokens", "factor")
        ]

    assert cells("cpu-0", "float32") == ["46,080", "2,048", "4,112", "1.00×"]
    assert cells("cpu-0", "bfloat16") == ["23,040", "4,096", "8,224", "2.00×"]
    assert cells("cpu-0", "fp8") == ["11,520", "8,192", "16,448", "4.00×"]
    assert cells("cpu-0", "int8") == ["11,880", "7,936", "15,936", "3.88×"]
    expect(table.locator("tr[data-worker='cpu-0'][data-dtype='float32']")).to_contain_text("now")
    l2 = table.locator("tr[data-worker='cpu-1'][data-dtype='fp8'] [data-f=l2_tokens]")
    expect(l2).to_have_text("—")
    expect(l2).to_have_attribute("title", "not reported by the worker")
    expect(table.locator("tr[data-worker='gone-0']")).to_contain_text("did not answer /get_model_info")
    table.scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "capacity-kv-dtypes.png"), full_page=True)
    assert not serious_violations(page)
    assert not errors
    print(f"screenshot in {tmp_path}")


def test_the_sizing_calculator_sizes_a_tp_workers_pools_per_rank(
    asgi_server, console_page, personas, tmp_path
):  # noqa: E501
    """A TP-2 worker: the calculator takes its tp size and says its L1 and L2 are per rank; back at tp 1
    the table is the whole worker's."""
    from playwright.sync_api import expect

    EngineWorkerFactory(name="tp2-0", host=HostFactory(name=AGENT_HOST), page_size=16, tp_size=2)
    page, errors = console_page("bob", "viewer")
    page.goto(f"{asgi_server}/capacity/")
    form = page.locator("#sizing-form")
    expect(form.get_by_label("--tp-size")).to_have_value("2")
    # it answers nothing, so no bytes per token: the page asks for them instead of showing an API error
    expect(page.get_by_test_id("bytes-source")).to_have_text(
        "tp2-0 did not answer /get_model_info: enter the model's bytes per token"
    )
    expect(page.locator("#sizing-error")).to_have_text("")
    form.get_by_role("button", name="Calculate").click()
    expect(page.locator("#sizing-error")).to_have_text(
        "KV bytes per token: enter the model's (the worker did not report it)."
    )
    form.get_by_label("KV bytes per token (one rank's)").fill("23040")
    form.get_by_label("--max-total-tokens").fill("4096")
    form.get_by_role("button", name="Calculate").click()
    expect(page.get_by_test_id("sizing-caption")).to_have_text(
        "Per rank (each of the 2 ranks has these pools, on its own device; host RAM is shared by the ranks)"
    )
    expect(page.get_by_test_id("rank-note")).to_have_text("L1 and L2 are sized per rank")
    expect(page.locator("#sizing-table tbody tr").first).to_contain_text("4,096")
    page.locator("#sizing-table").scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "capacity-per-rank.png"), full_page=True)  # looked at by eye
    form.get_by_label("--tp-size").fill("1")
    form.get_by_role("button", name="Calculate").click()
    expect(page.get_by_test_id("sizing-caption")).to_have_text("Per worker")
    # no L3 size entered, no hierarchical cache: those tiers are visibly absent ("—" with the reason),
    # never "0" / "0 B"
    l2, l3 = (page.locator("#sizing-table tbody tr").nth(i).locator("td") for i in (1, 2))
    for i in (1, 2, 3):
        expect(l3.nth(i)).to_have_text("—")
        expect(l2.nth(i)).to_have_text("—")
    expect(l3.nth(2)).to_have_attribute("title", re.compile("no L3 attached"))
    expect(l2.nth(2)).to_have_attribute("title", re.compile("without --enable-hierarchical-cache"))
    page.locator("#sizing-table").scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "capacity-sizing-no-l3.png"), full_page=True)  # looked at by eye
    form.get_by_label("L3 size (bytes)").fill(str(100 * 16 * 23040))  # 100 pages
    form.get_by_role("button", name="Calculate").click()
    expect(l3.nth(1)).to_have_text("1,600")
    expect(l3.nth(2)).to_have_text("35.2 MiB")
    assert not errors
