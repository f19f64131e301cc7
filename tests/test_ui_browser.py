"""The page at / of `selfspec serve`, in a real browser: Debian's headless Chromium driven by
Selenium, against a real server on a tiny model. Screenshots land in tests/artifacts/."""

import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from serving import Running, tiny_served  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"no {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver "
                "(scripts/setup.sh does when run as root)", allow_module_level=True)

# Without the background-networking flags Chromium keeps calling out, and a closed network refuses it.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,860"]
ARTIFACTS = Path(__file__).parent / "artifacts"
KEY = "page-test-key"
REPEATING = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"  # prompt lookup finds drafts in it
SOURCES = {"lookup", "suffix", "head", "layers", "bonus", "correction", "ar"}


@pytest.fixture(scope="module")
def served():
    running = Running(tiny_served(), api_key=KEY)
    yield running
    running.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = Options()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _status(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _wait(driver, condition, what: str, seconds: float = 60):
    return WebDriverWait(driver, seconds).until(lambda d: condition(d), message=what)


def _visible(driver, selector: str) -> bool:
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return bool(found) and found[0].is_displayed()


def _script_errors(driver) -> list[str]:
    """Console errors but the API's expected refusals (401: the page has no key yet)."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and "401" not in e["message"]]


def _no_error(driver) -> None:
    """The page shows no error (#error: a failed request or a script error while streaming)."""
    shown = _visible(driver, "#error")
    assert not shown, f"the page shows an error: {driver.find_element(By.ID, 'error').text}"


def _number(driver, selector: str) -> float:
    return float(driver.find_element(By.CSS_SELECTOR, selector).text)


def _shot(driver, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / name))


def test_the_page_loads_without_the_key_and_the_api_refuses_without_it(served, browser):
    assert _status(served.url + "/") == 200 and _status(served.url + "/ui/app.js") == 200
    assert _status(served.url + "/v1/models") == 401 and _status(served.url + "/v1/models", KEY) == 200
    browser.get(served.url + "/")
    _wait(browser, lambda d: _visible(d, "#key"), "the page did not ask for the API key")
    legend = browser.find_elements(By.CSS_SELECTOR, "#legend .swatch")
    assert {c.removeprefix("src-") for s in legend for c in s.get_attribute("class").split()} >= SOURCES
    browser.find_element(By.ID, "key-input").send_keys("wrong")
    browser.find_element(By.CSS_SELECTOR, "#key button").click()
    _wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-note").text, "a wrong key was not refused")
    key = browser.find_element(By.ID, "key-input")
    key.clear()
    key.send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key button").click()
    _wait(browser, lambda d: d.find_element(By.ID, "model").text == served.name, "the page did not connect with the key")
    assert not _visible(browser, "#key")
    assert _script_errors(browser) == []


def test_completion_side_by_side_with_ar_shows_sources_figures_and_identical_text(served, browser):
    browser.find_element(By.CSS_SELECTOR, "#modes [data-mode=completion]").click()
    Select(browser.find_element(By.ID, "method")).select_by_visible_text("hybrid")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("48")
    browser.find_element(By.ID, "compare").click()
    browser.find_element(By.ID, "prompt").send_keys(REPEATING)
    browser.find_element(By.ID, "send").click()
    _wait(browser, lambda d: _visible(d, "#verdict") or _visible(d, "#error"), "the side-by-side comparison never finished")
    _no_error(browser)
    verdict = browser.find_element(By.ID, "verdict")
    assert "identical" in verdict.text and "same" in verdict.get_attribute("class"), verdict.text

    tokens = browser.find_elements(By.CSS_SELECTOR, "#pane-spec .reply .tok")
    sources = {c.removeprefix("src-") for t in tokens for c in t.get_attribute("class").split() if c.startswith("src-")}
    assert len(tokens) >= 10 and sources <= SOURCES
    assert sources & {"lookup", "layers"}, f"no token accepted from a draft: {sources}"  # hybrid on the tiny model
    assert sources & {"bonus", "correction"}
    plain = browser.find_elements(By.CSS_SELECTOR, "#pane-ar .reply .tok")
    assert {t.get_attribute("class") for t in plain} == {"tok src-ar"}
    assert "".join(t.text for t in tokens).split() == "".join(t.text for t in plain).split()

    assert _number(browser, "#stat-tps") > 0
    assert 0 <= _number(browser, "#stat-alpha") <= 1 and _number(browser, "#stat-mal") >= 1
    bars = browser.find_elements(By.CSS_SELECTOR, "#chart rect.bar")
    assert bars and all(0 <= float(b.get_attribute("data-alpha")) <= 1 for b in bars)
    assert "tok/s" in browser.find_element(By.CSS_SELECTOR, "#pane-ar .speed").text
    _shot(browser, "ui_completion_side_by_side.png")
    assert _script_errors(browser) == []


def test_chat_turns_keep_the_conversation(served, browser):
    browser.find_element(By.CSS_SELECTOR, "#modes [data-mode=chat]").click()
    browser.find_element(By.ID, "compare").click()  # off again
    Select(browser.find_element(By.ID, "method")).select_by_visible_text("lookup")
    for turn in (REPEATING, "w5 w6 w7"):
        browser.find_element(By.ID, "prompt").send_keys(turn)
        browser.find_element(By.ID, "send").click()
        _wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled()
              and not d.find_element(By.ID, "prompt").get_attribute("value") or _visible(d, "#error"),
              "a chat turn never finished")
        _no_error(browser)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#pane-spec .turn.user")) == 2
    replies = browser.find_elements(By.CSS_SELECTOR, "#pane-spec .turn.reply")
    assert len(replies) == 2 and all(r.find_elements(By.CSS_SELECTOR, ".tok") for r in replies)
    assert not _visible(browser, "#pane-ar")
    _shot(browser, "ui_chat.png")
    assert _script_errors(browser) == []
