"""The admin in a real browser: staff log in, find, edit and delete through the pages as they render.

Headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which ``make test``
installs where it can) drives the admin served by a live server on the SQLite database;
the tests skip, saying why, where there is no such browser.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from afkmemory import models
from afkmemory.memory import LongTermMemory, MemoryEvent
from afkmemory.stores import SyncDjangoMemoryStore

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (requirements/test.txt)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", shutil.which("chromedriver") or "/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
        reason=f"no headless Chromium at {CHROMIUM} and chromedriver at {CHROMEDRIVER}"
        " (Debian: apt-get install chromium chromium-driver)",
    ),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(5)  # for elements of a page still loading
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def staff(browser: Any, live_server: Any) -> Any:
    """The browser, logged in to the admin as a superuser through its login page."""
    get_user_model().objects.create_superuser("admin", "admin@example.com", "pw")
    browser.delete_all_cookies()
    browser.get(f"{live_server.url}/admin/login/?next=/admin/")
    browser.find_element(By.ID, "id_username").send_keys("admin")
    browser.find_element(By.ID, "id_password").send_keys("pw")
    loads(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click)
    assert browser.find_element(By.ID, "site-name").text  # the admin's index, logged in
    browser.admin = f"{live_server.url}/admin/afkmemory"
    return browser


@pytest.fixture
def filled() -> SyncDjangoMemoryStore:
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("e1", "thread-1", "u1", "message", 1, {"text": "hi"}, []))
    store.put_state("thread-1", "plan", {"step": 1})
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="likes tea"), embedding=[1.0] * 8)
    store.upsert_long_term_memory(LongTermMemory("m2", "u1", text="owns a bicycle"))
    return store


def loads(browser: Any, action: Any) -> None:
    """Do ``action`` (a click, a submit) and wait for the page it leads to: until the old page has
    gone, finding elements would find the old page's (the admin's lists all look alike)."""
    page = browser.find_element(By.TAG_NAME, "html")
    action()
    WebDriverWait(browser, 10).until(expected_conditions.staleness_of(page))


def field(browser: Any, name: str, value: str) -> None:
    element = browser.find_element(By.NAME, name)
    element.clear()
    element.send_keys(value)


def test_staff_find_a_memory_by_its_text_edit_it_and_it_stays_searchable(staff, filled):
    staff.get(f"{staff.admin}/longtermmemory/")
    loads(staff, lambda: staff.find_element(By.ID, "searchbar").send_keys("tea\n"))
    rows = staff.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert [row.find_element(By.CSS_SELECTOR, "th a").text for row in rows] == ["m1"]
    loads(staff, rows[0].find_element(By.CSS_SELECTOR, "th a").click)
    field(staff, "text", "likes green tea")
    field(staff, "tags", '["drinks"]')
    loads(staff, staff.find_element(By.NAME, "_save").click)
    assert "was changed successfully" in staff.find_element(By.CSS_SELECTOR, ".messagelist .success").text
    [found] = filled.search_long_term_memory_text("u1", "green")
    assert (found.id, found.text, found.tags) == ("m1", "likes green tea", ["drinks"])
    assert filled.search_long_term_memory_vector("u1", [1.0] * 8, limit=1)[0][0].id == "m1"  # embedding kept


def test_staff_narrow_the_memories_to_a_typed_scope_keeping_their_search(staff, filled):
    filled.upsert_long_term_memory(LongTermMemory("m3", "u1", scope="work", text="likes coffee"))
    staff.get(f"{staff.admin}/longtermmemory/?q=likes")
    loads(staff, lambda: staff.find_element(By.CSS_SELECTOR, "input[name=scope]").send_keys("work\n"))
    rows = staff.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert [row.find_element(By.CSS_SELECTOR, "th a").text for row in rows] == ["m3"]
    assert staff.find_element(By.ID, "searchbar").get_attribute("value") == "likes"  # the search stays
    loads(staff, staff.find_element(By.CSS_SELECTOR, "[data-filter-title=scope] a").click)  # "All"
    listed = [row.text for row in staff.find_elements(By.CSS_SELECTOR, "#result_list tbody th a")]
    assert sorted(listed) == ["m1", "m3"]  # "likes tea", "likes coffee"; not "owns a bicycle"


def test_a_value_the_stores_would_refuse_is_shown_on_the_form_and_not_saved(staff, filled):
    staff.get(f"{staff.admin}/longtermmemory/")
    loads(staff, staff.find_element(By.LINK_TEXT, "m2").click)
    field(staff, "metadata", "[1, 2]")  # metadata is a JSON object
    loads(staff, staff.find_element(By.NAME, "_save").click)
    errors = staff.find_element(By.CSS_SELECTOR, ".field-metadata .errorlist").text
    assert "JSON object" in errors
    assert "Please correct the error below." in staff.find_element(By.CSS_SELECTOR, ".errornote").text
    assert models.LongTermMemory.objects.get(memory_id="m2").metadata == {}


def test_a_threads_records_are_a_click_away_and_deleting_it_takes_them_along(staff, filled):
    staff.get(f"{staff.admin}/thread/")
    row = staff.find_element(By.CSS_SELECTOR, "#result_list tbody tr")
    loads(staff, row.find_element(By.LINK_TEXT, "event").click)
    events = staff.find_elements(By.CSS_SELECTOR, "#result_list tbody tr th")
    assert [cell.text for cell in events] == ["e1"]

    staff.get(f"{staff.admin}/thread/")
    staff.find_element(By.CSS_SELECTOR, "#result_list tbody tr input.action-select").click()
    Select(staff.find_element(By.NAME, "action")).select_by_value("delete_selected")
    loads(staff, staff.find_element(By.NAME, "index").click)  # "Go"
    summary = staff.find_element(By.CSS_SELECTOR, "#content").text
    assert "Events: 1" in summary and "State entries: 1" in summary  # what goes with it, listed first
    loads(staff, staff.find_element(By.CSS_SELECTOR, "input[type=submit]").click)  # "Yes, I'm sure"
    assert "Successfully deleted 1 thread" in staff.find_element(By.CSS_SELECTOR, ".messagelist .success").text
    assert not models.Thread.objects.exists() and not models.Event.objects.exists()
    assert not models.StateEntry.objects.exists()
    assert models.LongTermMemory.objects.count() == 2  # memories are the user's, not the thread's
