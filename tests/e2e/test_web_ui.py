"""The playground (`/`) and the live dashboard (`/dashboard`) in a real headless Chromium (Playwright, driving
the system's Chromium: `make test` installs Debian's `chromium`) against a live `tokenmill serve` on a tiny
model. Screenshots go to test-artifacts/web/ at the repository's root."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from helpers.tiny_models import make_tiny_hf_model, make_tiny_llava
from server_harness import ServerProcess, metric, metric_samples, wait_for_metrics

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
API_KEY = "browser-secret"
JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["unit"],
               "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}}}}}]


def chromium_path() -> str:
    for name in (os.environ.get("TOKENMILL_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    pytest.fail("no Chromium found for the browser tests: install Debian's `chromium` (`make test` does, as root) "
                "or point TOKENMILL_CHROMIUM at one")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=4096))


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """"open": the server without a key that most tests share, on the tiny text model (the restart test restarts
    it last). "guarded": a tiny random LLaVA behind API_KEY, which the image tests and the API-key test share
    (that test needs no particular model, so one server serves both)."""
    logs = tmp_path_factory.mktemp("logs")
    open_server = ServerProcess(model, "--max-model-len", "1024", "--num-kv-blocks", "256", "--block-size", "16",
                                log_path=logs / "open.log").start()
    vision = make_tiny_llava(tmp_path_factory.mktemp("llava") / "model", "clip")
    guarded = ServerProcess(str(vision), "--max-model-len", "512", "--num-kv-blocks", "256", "--api-key", API_KEY,
                            log_path=logs / "vlm.log").start()
    try:
        yield {"open": open_server.wait_ready(), "guarded": guarded.wait_ready()}
    finally:
        open_server.terminate()
        guarded.terminate()
        open_server.stop()
        guarded.stop()


@pytest.fixture(scope="module")
def vision_server(servers):
    """`tokenmill serve` on a tiny random LLaVA (a vision-language model), behind API_KEY (see `save_key`)."""
    return servers["guarded"]


def write_png(path: Path, seed: int = 0) -> Path:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (24, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "PNG")
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    yield page
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^\w.-]+", "_", request.node.name).strip("_")
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    context.close()
    assert not page.errors, f"the page raised: {page.errors}"


def save_key(page, url: str) -> None:
    """Open the playground at `url` and give it API_KEY in the key dialog it opens, as a user does."""
    page.goto(url + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", API_KEY)
    page.click("#key-dialog button[value=save]")
    page.wait_for_function("document.querySelector('#model').textContent.startsWith('model:')")


def settings(page, **values) -> None:
    for name, value in values.items():
        field = page.locator(f"#{name}")
        if field.evaluate("node => node.tagName") == "SELECT":
            field.select_option(str(value))
        elif field.get_attribute("type") == "checkbox":
            field.set_checked(bool(value))
        else:
            field.fill(str(value))


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def wait_answered(page, timeout: float = 60_000) -> str:
    """The last answer's text once its request is over."""
    page.wait_for_function("!document.querySelector('#send').disabled && "
                           "document.querySelector('.message.assistant:last-child .stats').textContent.length > 0",
                           timeout=timeout)
    return page.locator(".message.assistant").last.locator(".content").inner_text()


def test_a_chat_answer_streams_in_token_by_token_with_its_figures(servers, page):
    page.goto(servers["open"].url + "/")
    settings(page, max_tokens=120, temperature=0.8, seed=3)
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const answer = document.querySelector('.message.assistant:last-child .content');
            if (answer) window.lengths.push(answer.textContent.length);
        }).observe(document.querySelector('#messages'), {childList: true, subtree: true});
    }""")
    send(page, "Tell me a story about a lighthouse.")
    text = wait_answered(page)
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 5, f"the answer arrived in {len(set(lengths))} pieces, not streamed"
    assert text and max(lengths) == len(text)
    stats = page.locator(".message.assistant .stats").last.inner_text()
    assert "TTFT" in stats and "tokens/s" in stats and "120 tokens" in stats and "finish: length" in stats
    token = page.locator(".message.assistant .token[title]").first  # logprobs on hover
    assert token.get_attribute("title").startswith("logprob ")
    page.reload()  # the conversation is kept in the browser's storage
    assert page.locator(".message.assistant .content").last.inner_text() == text


def test_stop_aborts_the_request_on_the_server(servers, page):
    url = servers["open"].url
    aborted = metric(metric_samples(url), "tokenmill:request_success_total", finish_reason="abort")
    page.goto(url + "/")
    page.click("#clear")
    settings(page, max_tokens=900, mode="completion")
    send(page, "Once upon a time")
    page.wait_for_function("document.querySelectorAll('.message.assistant .token').length > 5", timeout=30_000)
    page.click("#stop-button")
    wait_answered(page)
    assert "finish: stopped" in page.locator(".message.assistant .stats").last.inner_text()
    wait_for_metrics(url, lambda s: metric(s, "tokenmill:request_success_total", finish_reason="abort") > aborted)
    assert page.locator("#error").is_hidden()


def test_structured_answers_parse_and_forced_tools_show_their_calls(servers, page):
    page.goto(servers["open"].url + "/")
    page.click("#clear")
    settings(page, mode="chat", temperature=1.0, max_tokens=60, constraint="json_schema")
    page.fill("#constraint-value", json.dumps(JSON_SCHEMA))
    parsed = []
    for seed in range(6):
        settings(page, seed=seed)
        send(page, "Which unit?")
        text = wait_answered(page)
        if "finish: stop" in page.locator(".message.assistant .stats").last.inner_text():
            parsed.append(json.loads(text))
    assert parsed and all(answer["unit"] in ("celsius", "fahrenheit") for answer in parsed)
    settings(page, constraint="none", tool_choice="required", seed=1, max_tokens=80)
    page.fill("#tools", json.dumps(TOOL))
    send(page, "What is the weather in Paris?")
    wait_answered(page)
    calls = json.loads(page.locator(".message.assistant .tool-calls").last.inner_text())
    assert calls[0]["function"]["name"] == "get_weather" and "city" in json.loads(calls[0]["function"]["arguments"])


def test_each_chat_api_streams_the_same_greedy_answer(servers, page):
    page.goto(servers["open"].url + "/")
    page.wait_for_function("document.querySelector('#model').textContent.startsWith('model:')")
    settings(page, mode="chat", temperature=0, max_tokens=12, constraint="none", tools="", tool_choice="auto")
    answers = {}
    for api in ("chat_completions", "responses", "messages"):
        page.click("#clear")
        settings(page, api=api)
        send(page, "Name three colours.")
        answers[api] = wait_answered(page)
        assert "12 tokens" in page.locator(".message.assistant .stats").last.inner_text(), api
    assert answers["chat_completions"] and len(set(answers.values())) == 1, answers
    assert page.locator("#error").is_hidden()


def test_the_servers_4xx_message_is_shown_verbatim_and_a_dropped_connection_can_be_retried(servers, page):
    url = servers["open"].url
    expected = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "top_p": 5}).json()["error"]["message"]
    page.goto(url + "/")
    page.click("#clear")
    settings(page, mode="chat", top_p=5, max_tokens=8, tools="", tool_choice="auto")
    send(page, "hi")
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error-text") == expected
    assert page.locator("#retry").is_hidden()  # the server answered: sending it again would not help
    settings(page, top_p=1)
    page.route("**/v1/chat/completions", lambda route: route.abort())
    send(page, "hello again")
    page.wait_for_selector("#retry:not([hidden])")
    assert "connection" in page.inner_text("#error-text")
    page.unroute("**/v1/chat/completions")
    page.click("#retry")
    assert wait_answered(page)
    assert page.locator("#error").is_hidden()


IMAGE_PATHS = {"chat_completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def sent_images(api: str, body: dict) -> list[str]:
    """The images (data URLs) of the last user turn of a request body the page sent, read in each API's shape;
    asserts the text part comes after them."""
    turn = (body["input"] if api == "responses" else body["messages"])[-1]
    assert turn["role"] == "user" and isinstance(turn["content"], list), turn
    *images, text = turn["content"]
    if api == "chat_completions":
        assert text == {"type": "text", "text": "What is this?"}
        return [part["image_url"]["url"] for part in images if part["type"] == "image_url"]
    if api == "responses":
        assert text == {"type": "input_text", "text": "What is this?"}
        return [part["image_url"] for part in images if part["type"] == "input_image"]
    assert text == {"type": "text", "text": "What is this?"}
    return [f"data:{part['source']['media_type']};base64,{part['source']['data']}"
            for part in images if part["type"] == "image" and part["source"]["type"] == "base64"]


def test_an_attached_image_goes_with_the_message_through_each_chat_api(vision_server, page, tmp_path):
    url = vision_server.url
    png = write_png(tmp_path / "picture.png")
    expected_url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    encoded = metric(metric_samples(url), "tokenmill:encoder_images_total")
    save_key(page, url)
    settings(page, mode="chat", temperature=0, max_tokens=8)
    answers = {}
    for api, path in IMAGE_PATHS.items():
        page.click("#clear")
        settings(page, api=api)
        page.set_input_files("#attach", str(png))
        page.wait_for_selector("#attachments:not([hidden]) img.thumb[alt='picture.png']")
        with page.expect_request(lambda r, path=path: r.url.endswith(path) and r.method == "POST") as request:
            send(page, "What is this?")
        assert sent_images(api, request.value.post_data_json) == [expected_url], api
        answers[api] = wait_answered(page)
        assert "finish:" in page.locator(".message.assistant .stats").last.inner_text()
        assert page.locator("#attachments").is_hidden()  # sent: the attachments are cleared
        assert page.locator(".message.user .images img.thumb").count() == 1  # and shown in the user's bubble
        if api == "chat_completions":
            wait_for_metrics(url, lambda s: metric(s, "tokenmill:encoder_images_total") > encoded)
            with page.expect_request(lambda r: r.url.endswith(path) and r.method == "POST") as request:
                send(page, "And its colours?")  # a later turn: the history keeps the image
            history = request.value.post_data_json["messages"]
            assert [p["image_url"]["url"] for p in history[0]["content"] if p["type"] == "image_url"] == [expected_url]
            assert history[-1] == {"role": "user", "content": "And its colours?"}
            assert wait_answered(page)
    assert answers["chat_completions"] and len(set(answers.values())) == 1, answers  # greedy: the same answer
    assert page.locator("#error").is_hidden()


def test_a_text_only_model_refuses_an_attached_image_with_its_message_verbatim(servers, page, tmp_path):
    url = servers["open"].url
    first, second = write_png(tmp_path / "first.png", 1), write_png(tmp_path / "second.png", 2)
    second_url = "data:image/png;base64," + base64.b64encode(second.read_bytes()).decode()
    response = httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": second_url}}, {"type": "text", "text": "What is this?"}]}]})
    assert response.status_code == 400
    expected = response.json()["error"]["message"]
    assert "takes no images" in expected
    page.goto(url + "/")
    page.click("#clear")
    settings(page, mode="chat", api="chat_completions", max_tokens=8, tools="", tool_choice="auto")
    page.set_input_files("#attach", [str(first), str(second)])
    page.wait_for_function("document.querySelectorAll('#attachments img.thumb').length === 2")
    from axe_playwright_python.sync_playwright import Axe

    violations = Axe().run(page).response["violations"]  # the thumbnails and their remove buttons are labelled
    assert not [(v["id"], v["help"]) for v in violations if v["impact"] in ("serious", "critical")]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#composer").screenshot(path=str(ARTIFACTS / "attachments.png"))
    page.click("#attachments button[aria-label='Remove first.png']")
    page.wait_for_function("document.querySelectorAll('#attachments img.thumb').length === 1")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions") and r.method == "POST") as request:
        send(page, "What is this?")
    assert sent_images("chat_completions", request.value.post_data_json) == [second_url]
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error-text") == expected
    assert page.locator("#retry").is_hidden()


def test_with_an_api_key_the_pages_load_and_ask_for_it(servers, page):
    url = servers["guarded"].url
    assert httpx.get(f"{url}/").status_code == 200 and httpx.get(f"{url}/static/playground.js").status_code == 200
    assert httpx.get(f"{url}/v1/engine/stream").status_code == 401
    save_key(page, url)
    settings(page, max_tokens=8)
    send(page, "hi")
    assert wait_answered(page)
    page.goto(url + "/dashboard")  # the key is kept: the stream opens with it
    page.wait_for_function("window.tokenmillDashboard.samples > 1", timeout=20_000)
    # --api-key is one admin tenant: the tenants' table shows it, with the first-token time of its "hi"
    row = page.locator("#tenants-card:not([hidden]) tbody tr")
    assert row.locator("th").inner_text() == "default"
    assert row.locator("td").nth(3).inner_text() != "–"


def test_the_dashboard_moves_under_load_and_shows_cached_blocks(servers, page):
    url = servers["open"].url
    page.goto(url + "/dashboard")
    page.wait_for_function("window.tokenmillDashboard.samples > 0", timeout=20_000)
    assert page.locator("#tenants-card").is_hidden()  # no keys, no tenants
    prompt = "the quick brown fox jumps over the lazy dog " * 10
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    seen_running = threading.Event()

    def keep_busy() -> None:  # requests until the dashboard has shown one running (a sample may fall between
        for _ in range(50):  # short requests on a busy machine), at least one per thread, 50 at most
            httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if seen_running.is_set():
                return

    load = [threading.Thread(target=keep_busy) for _ in range(3)]
    for thread in load:
        thread.start()
    try:
        page.wait_for_function("Number(document.querySelector('#fig-running').textContent.split(' ')[0]) > 0",
                               timeout=120_000)
    finally:
        seen_running.set()
        for thread in load:
            thread.join()
    page.wait_for_function("window.tokenmillDashboard.steps > 10 && "
                           "Number(document.querySelector('#timeline').dataset.requests) >= 3", timeout=30_000)
    page.wait_for_function("JSON.parse(document.querySelector('#kv-map').dataset.counts || '{}').evictable > 0",
                           timeout=10_000)
    assert float(page.inner_text("#fig-hits").rstrip("%")) > 0  # the repeated prompt hit the prefix cache
    assert "evictable" in page.get_attribute("#kv-map", "aria-label")
    page.fill("#slo-e2el", "600000")  # ten minutes: every finished request meets it
    page.wait_for_function("Number(document.querySelector('#slo-result').dataset.done) >= 3")
    result = page.locator("#slo-result")
    assert result.get_attribute("data-good") == result.get_attribute("data-done")
    page.fill("#slo-ttft", "1")  # no first token within a millisecond of arrival
    page.wait_for_function("document.querySelector('#slo-result').dataset.good === '0'")
    assert "(0.0%)" in result.inner_text()


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_the_pages_pass_an_accessibility_check(servers, page, path):
    from axe_playwright_python.sync_playwright import Axe

    page.goto(servers["open"].url + path)
    if path == "/dashboard":
        page.wait_for_function("window.tokenmillDashboard.samples > 0", timeout=20_000)
    results = Axe().run(page)
    serious = [(v["id"], v["impact"], v["help"]) for v in results.response["violations"]
               if v["impact"] in ("serious", "critical")]
    assert not serious, serious
    page.keyboard.press("Tab")  # keyboard navigation reaches the controls
    assert page.evaluate("document.activeElement.tagName") in ("A", "BUTTON", "SELECT", "INPUT", "TEXTAREA")


def test_the_dashboard_reconnects_after_a_server_restart(servers, browser):
    """Restarts the open server in place: the same command on the same port, so the tests that share it see
    the same server afterwards (it is last all the same, so that a failed restart fails no other test).
    The page retries every 100 ms at most instead of the default 5 s, so that it reconnects as soon as the
    server is back rather than at its next 5 s try."""
    server = servers["open"]
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(server.url + "/dashboard?reconnect_max_ms=100")
        page.wait_for_function("window.tokenmillDashboard.samples > 1", timeout=20_000)
        port = server.port
        # killed: a graceful stop waits for open connections, and the dashboard's stream ends only with the
        # process (stop() would kill it after 15 s all the same)
        server.proc.kill()
        server.stop()
        page.wait_for_function("document.querySelector('#connection').dataset.state === 'reconnecting'",
                               timeout=20_000)
        seen = page.evaluate("window.tokenmillDashboard.samples")
        server.start(port=port).wait_ready()
        page.wait_for_function(f"window.tokenmillDashboard.samples > {seen + 1} && "
                               "document.querySelector('#connection').dataset.state === 'connected'", timeout=30_000)
    finally:
        context.close()
