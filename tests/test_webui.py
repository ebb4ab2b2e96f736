"""The chat page at `/` (jllama/server/webui/index.html), in a real browser: headless Chromium
driven by Selenium against a `ServerThread` on the tiny Llama 3.2 test model (it has a chat
template; stories260K has none and its chat requests are a 400). Plain HTTP checks that the
page is served, and that `webui=False` and `jllama serve --no_webui` leave it out.

The browser tests need Debian's `chromium` and `chromium-driver` packages and the `selenium`
package (the `test` extra); without them they skip, saying which is missing.

`python tests/test_webui.py docs/webui.png` writes the screenshot in docs/server.md: a chat
with SmolLM2-135M-Instruct (`jllama fetch smollm2`) on the page.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving import openai_client

from jllama.backends import make_backend
from jllama.model.loading import open_model
from jllama.server import ServerThread

LLAMA32_TINY = Path(__file__).parent / "data" / "llama32_tiny" / "hf"
MODEL = "llama32-tiny"
CONTEXT = 1024
WAIT_S = 20


def _serve(path, model_id: str, seq_len: int | None = None, **options) -> ServerThread:
    model = open_model(path, seq_len=seq_len) if seq_len else open_model(path)
    backend = make_backend("jax")
    backend.prepare(model.config, model.weights)
    return ServerThread(model, backend, model_id, **options)


@pytest.fixture(scope="module")
def server():
    with _serve(LLAMA32_TINY, MODEL, seq_len=CONTEXT) as running:
        yield running


def _chromium() -> tuple[str, str]:
    """(the browser, its driver), or a skip naming what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                   "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no Chromium or chromedriver here (apt-get install chromium chromium-driver)")
    return browser, driver


def open_browser(width: int = 1200, height: int = 800):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    # The driver given by path: Selenium Manager would try to download one.
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def browser():
    driver = open_browser()
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = WAIT_S):
    """The first truthy value of `script` (a JS expression), polled until `timeout`."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(
        lambda d: d.execute_script(f"return {script};")
    )


@pytest.fixture()
def page(server, browser):
    """The page at / with an empty conversation and stored settings, its model loaded."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear();")
    browser.get(server.url + "/")
    wait_for(browser, "window.jllama && document.getElementById('model').textContent"
                      ".includes('context')")
    return browser


def fill(driver, element_id: str, text: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    if text:
        element.send_keys(text)


def send(driver, text: str) -> None:
    """Types `text` and clicks Send; returns once the reply has ended."""
    before = driver.execute_script("return window.jllama.replies.length;")
    fill(driver, "input", text)
    driver.find_element("id", "send").click()
    wait_for(driver, f"window.jllama.replies.length > {before} && "
                     "document.getElementById('send').textContent === 'Send'")


def bubbles(driver, kind: str) -> list:
    return driver.find_elements("css selector", f"#messages .message.{kind}")


# ------------------------------------------------------------------------------------------
# Plain HTTP.


def test_the_page_is_served_at_the_root(server):
    with httpx.Client(timeout=WAIT_S) as http:
        for path in ("/", "/index.html", "/index.html/"):
            reply = http.get(server.url + path)
            assert reply.status_code == 200, path
            assert reply.headers["content-type"] == "text/html; charset=utf-8"
            assert "<title>jllama chat</title>" in reply.text
            policy = reply.headers["content-security-policy"]
            assert "script-src 'sha256-" in policy and "unsafe-inline" not in policy
        head = http.head(server.url + "/")
        assert head.status_code == 200 and head.content == b""
        # Nothing from elsewhere: the machine serving it may be offline.
        assert "http://" not in reply.text and "https://" not in reply.text
    # The model card's context, an extra field the openai client keeps.
    with openai_client(server) as client:
        card = client.models.list().data[0]
    assert card.id == MODEL and card.context_length == CONTEXT


def test_webui_false_is_a_404():
    with _serve(None, "stories260K", webui=False) as running, httpx.Client() as http:
        for path in ("/", "/index.html"):
            reply = http.get(running.url + path)
            assert reply.status_code == 404
            assert reply.json()["error"]["code"] == "not_found"
        models = http.get(running.url + "/v1/models").json()
        assert models["data"][0]["context_length"] == 512  # stories260K's


def test_serve_no_webui_flag():
    from test_cli import jllama_command

    process = subprocess.Popen(jllama_command() + ["serve", "--port=0", "--no_webui"],
                               stderr=subprocess.PIPE, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            lines.append(process.stderr.readline())
            if "serving stories260K" in lines[-1]:
                url = lines[-1].split(" at ")[1].split()[0].removesuffix("/v1")
                break
        assert url, lines
        with httpx.Client(timeout=WAIT_S) as http:
            assert http.get(url + "/").status_code == 404
            assert http.get(url + "/v1/models").status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(20) == 130
            assert "chat page" not in process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)


# ------------------------------------------------------------------------------------------
# In Chromium.

# Records the last assistant bubble's text length at each change of the page, to see a reply
# arrive in pieces (a reply put on the page whole would show one length).
WATCH_LENGTHS = """
window.__lengths = [];
new MutationObserver(() => {
  const all = document.querySelectorAll('#messages .message.assistant .content');
  if (all.length) window.__lengths.push(all[all.length - 1].textContent.length);
}).observe(document.getElementById('messages'), {childList: true, subtree: true,
                                                 characterData: true});
"""


def test_a_two_turn_chat_streams_and_keeps_the_conversation(page):
    assert page.find_element("id", "model").text == f"{MODEL} · context {CONTEXT} tokens"
    fill(page, "system", "You are terse.")
    fill(page, "temperature", "0")
    fill(page, "max-tokens", "40")
    fill(page, "stop", "zzqq, qqzz")
    page.execute_script(WATCH_LENGTHS)

    send(page, "Hello there")
    first = page.execute_script("return window.jllama.replies[0];")
    assert "error" not in first, first["error"]
    assert first["usage"]["completion_tokens"] == first["chunks"] > 1
    lengths = page.execute_script("return window.__lengths;")
    shown = [n for n in lengths if n]
    assert len(set(shown)) > 1 and shown == sorted(shown), lengths  # grew, piece by piece
    assistant = bubbles(page, "assistant")
    assert len(assistant) == 1
    assert assistant[0].find_element("css selector", ".content").text.strip() == \
        first["text"].strip()
    assert "tokens/s" in assistant[0].find_element("css selector", ".stats").text

    send(page, "And then?")
    requests = page.execute_script("return window.jllama.requests;")
    assert len(requests) == 2
    assert requests[0]["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
    ]
    # The second turn carries the first, the reply as it came.
    assert requests[1]["messages"] == requests[0]["messages"] + [
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "And then?"},
    ]
    for body in requests:
        assert (body["model"], body["stream"], body["temperature"], body["max_tokens"],
                body["stop"]) == (MODEL, True, 0, 40, ["zzqq", "qqzz"])
        assert body["stream_options"] == {"include_usage": True}
    second = page.execute_script("return window.jllama.replies[1];")
    assert second["chunks"] > 1 and "error" not in second
    assert len(bubbles(page, "assistant")) == 2 and len(bubbles(page, "user")) == 2

    # A reload shows the stored conversation; New chat empties it.
    page.refresh()
    wait_for(page, "document.querySelectorAll('#messages .message.assistant').length === 2")
    page.find_element("id", "new-chat").click()
    assert page.execute_script("return window.jllama.messages.length;") == 0
    assert not bubbles(page, "assistant") and not bubbles(page, "user")
    send(page, "Hi")
    assert page.execute_script("return window.jllama.requests[0].messages;") == [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]


PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
REPLY = (
    f"{PAYLOAD}\n\n"
    "Some **bold**, *italic* and `<b>code</b>` with snake_case_name.\n\n"
    "- one\n- two <i>x</i>\n\n"
    "1. first\n2. second\n\n"
    "```html\n<script>window.__pwned=3</script>\n```\n"
)

# Replaces the page's fetch of /v1/chat/completions with a stream of `pieces` as
# chat.completion.chunk events (a few characters each, so tags arrive cut in two).
STUB_FETCH = """
const pieces = arguments[0];
const realFetch = window.fetch;
window.fetch = async (url, init) => {
  if (!String(url).endsWith('/v1/chat/completions')) return realFetch(url, init);
  const encoder = new TextEncoder();
  const body = new ReadableStream({
    async start(controller) {
      for (const piece of pieces) {
        const event = {object: 'chat.completion.chunk', choices: [
          {index: 0, delta: {content: piece}, finish_reason: null}]};
        controller.enqueue(encoder.encode('data: ' + JSON.stringify(event) + '\\n\\n'));
        await new Promise((resolve) => setTimeout(resolve, 1));
      }
      controller.enqueue(encoder.encode('data: [DONE]\\n\\n'));
      controller.close();
    }
  });
  return new Response(body, {headers: {'Content-Type': 'text/event-stream'}});
};
"""


def test_a_reply_is_text_never_html(page):
    pieces = [REPLY[i:i + 7] for i in range(0, len(REPLY), 7)]
    page.execute_script(STUB_FETCH, pieces)
    send(page, "Say something dangerous")
    time.sleep(0.3)  # an <img>'s onerror would have fired by now
    assert page.execute_script("return window.jllama.replies[0].text;") == REPLY
    assert page.execute_script("return typeof window.__pwned;") == "undefined"
    reply = bubbles(page, "assistant")[0].find_element("css selector", ".content")
    assert not reply.find_elements("css selector", "script, img, b, i")
    paragraphs = reply.find_elements("css selector", "p")
    assert paragraphs[0].text == PAYLOAD  # the literal text, on the page
    assert paragraphs[0].is_displayed()
    # The markdown, as elements.
    assert [e.text for e in reply.find_elements("css selector", "p strong")] == ["bold"]
    assert [e.text for e in reply.find_elements("css selector", "p em")] == ["italic"]
    assert [e.text for e in reply.find_elements("css selector", "p code")] == ["<b>code</b>"]
    assert "snake_case_name." in paragraphs[1].text
    assert [e.text for e in reply.find_elements("css selector", "ul > li")] == [
        "one", "two <i>x</i>"]
    assert [e.text for e in reply.find_elements("css selector", "ol > li")] == [
        "first", "second"]
    code = reply.find_element("css selector", "pre > code")
    assert code.text == "<script>window.__pwned=3</script>"
    assert code.get_attribute("class") == "language-html"


def test_a_server_error_shows_in_the_page(page, server):
    fill(page, "max-tokens", str(CONTEXT + 100))
    send(page, "Hello")
    with httpx.Client(timeout=WAIT_S) as http:  # the same request, by hand
        body = page.execute_script("return window.jllama.requests[0];")
        want = http.post(server.url + "/v1/chat/completions", json=body).json()["error"]
    assert want["code"] == "context_length_exceeded"
    error = page.find_element("css selector", "#messages .message.error .error-text")
    assert error.text == "Error: " + want["message"]
    # Nothing came back: the turn is taken back, its text back in the box.
    assert page.execute_script("return window.jllama.messages.length;") == 0
    assert page.find_element("id", "input").get_attribute("value") == "Hello"
    # With a reply that fits, the conversation goes on without the failed turn.
    fill(page, "max-tokens", "8")
    send(page, "Hello")
    assert page.execute_script("return window.jllama.requests[1].messages;") == [
        {"role": "user", "content": "Hello"}]
    assert "error" not in page.execute_script("return window.jllama.replies[1];")


def test_an_error_event_mid_stream_keeps_the_text(page):
    page.execute_script("""
    window.fetch = async () => new Response(
      'data: {"choices": [{"index": 0, "delta": {"content": "Half a"}}]}\\n\\n' +
      'data: {"error": {"message": "the server is shutting down", "code": "shutting_down"}}' +
      '\\n\\ndata: [DONE]\\n\\n', {headers: {'Content-Type': 'text/event-stream'}});
    """)
    send(page, "Go on")
    bubble = bubbles(page, "assistant")[0]
    assert bubble.find_element("css selector", ".content").text == "Half a"
    assert bubble.find_element("css selector", ".error-text").text == \
        "Error: the server is shutting down"
    assert page.execute_script("return window.jllama.messages;")[-1] == {
        "role": "assistant", "content": "Half a"}


def test_a_thinking_reply_shows_its_reasoning_apart(page):
    """delta.reasoning_content (a thinking model's, `jllama.server.reasoning`) goes into a
    folded "Thinking" block above the answer, as text, and not into the conversation."""
    events = [{"reasoning_content": piece} for piece in ("Two and ", "two: <b>four</b>")] + [
        {"content": piece} for piece in ("Four", ".")]
    page.execute_script("""
    const deltas = arguments[0];
    window.fetch = async () => new Response(deltas.map((delta) => 'data: ' + JSON.stringify(
      {choices: [{index: 0, delta: delta, finish_reason: null}]}) + '\\n\\n').join('') +
      'data: [DONE]\\n\\n', {headers: {'Content-Type': 'text/event-stream'}});
    """, events)
    send(page, "Two and two?")
    bubble = bubbles(page, "assistant")[0]
    thinking = bubble.find_element("css selector", "details.thinking")
    assert thinking.get_attribute("open") is None  # folded once the answer came
    thinking.find_element("css selector", "summary").click()
    assert thinking.find_element("css selector", ".thinking-text").text == \
        "Two and two: <b>four</b>"
    assert not thinking.find_elements("css selector", "b")
    assert bubble.find_element("css selector", ".content").text == "Four."
    assert page.execute_script("return window.jllama.messages;")[-1] == {
        "role": "assistant", "content": "Four."}


def test_the_api_key_goes_with_every_request(page):
    """A key in the API key box is sent as OpenAI's clients send it, to both routes (a
    server started with --api_key asks it of both); the box empty, no Authorization."""
    page.execute_script("""
    window.__sent = [];
    window.fetch = async (url, init) => {
      window.__sent.push([String(url), (init && init.headers && init.headers.Authorization)
                                       || null]);
      if (String(url).endsWith('/v1/models')) return new Response(JSON.stringify(
        {object: 'list', data: [{id: 'keyed', object: 'model', context_length: 64}]}));
      return new Response('data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}'
                          + '\\n\\ndata: [DONE]\\n\\n');
    };
    """)
    send(page, "no key")
    fill(page, "api-key", "sekrit")
    page.find_element("id", "system").click()  # the key box's change event
    wait_for(page, "document.getElementById('model').textContent.startsWith('keyed')")
    send(page, "with a key")
    assert page.execute_script("return window.__sent;") == [
        ["/v1/chat/completions", None],
        ["/v1/models", "Bearer sekrit"],
        ["/v1/chat/completions", "Bearer sekrit"],
    ]


# ------------------------------------------------------------------------------------------


def screenshot(path: str) -> None:
    """A chat with SmolLM2-135M-Instruct on the page, saved to `path` (docs/webui.png)."""
    fetched = subprocess.run([sys.executable, "-m", "jllama", "fetch", "smollm2"],
                             capture_output=True, text=True, check=True)
    with _serve(fetched.stdout.strip(), "smollm2", seq_len=2048) as running:
        driver = open_browser(1280, 960)
        try:
            driver.get(running.url + "/")
            driver.execute_script("localStorage.clear();")
            driver.get(running.url + "/")
            wait_for(driver, "document.getElementById('model').textContent.includes('context')")
            fill(driver, "system", "You are a helpful assistant.")
            fill(driver, "temperature", "0")
            fill(driver, "max-tokens", "200")
            for text in ("Give me three tips for staying focused, as a short numbered list.",
                         "Show a Python function that adds two numbers, in a ```python code "
                         "block."):
                send(driver, text)
            driver.save_screenshot(path)
            print(json.dumps(driver.execute_script("return window.jllama.messages;"), indent=1))
        finally:
            driver.quit()


if __name__ == "__main__":
    screenshot(sys.argv[1] if len(sys.argv) > 1 else "docs/webui.png")
