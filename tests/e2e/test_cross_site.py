"""Web pages cannot drive streamrft's HTTP servers: a real Chromium on a page of another
local origin sends the requests a hostile page can send without a preflight (``no-cors``
``text/plain`` POSTs, and ``application/json`` ones, which the browser must preflight)
to an explorer's recording endpoint (the serve API), and a DNS-rebinding-style request
(a name resolved to 127.0.0.1, so the browser calls it same-origin). Nothing is recorded;
the ``openai`` client, from a program, still works."""

from __future__ import annotations

import http.server
import threading

import openai
import pytest

from tests.helpers.browser import Browser, need_browser
from tests.helpers.endpoints import tiny_endpoint

pytestmark = pytest.mark.e2e

PAGE = """<!doctype html><script>
window.results = [];
async function attack(base) {
  const body = JSON.stringify({model: "policy", prompt: "1+1=", max_tokens: 2});
  for (const [path, type, mode] of [
    ["/v1/completions", "text/plain", "no-cors"],
    ["/v1/chat/completions", "text/plain", "no-cors"],
    ["/v1/completions", "application/json", "cors"],
  ]) {
    try {
      const r = await fetch(base + path, {method: "POST", mode, body,
                                          headers: {"Content-Type": type}});
      window.results.push([path, type, r.type, r.status]);
    } catch (e) { window.results.push([path, type, "error", String(e)]); }
  }
  window.done = true;
}
</script>"""


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_cross_site_and_rebinding_requests_record_nothing():
    need_browser()
    endpoint = tiny_endpoint("web-run", version=0, max_tokens=2)
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{endpoint.port}/ep/c1"
    browser = Browser(("--host-resolver-rules=MAP rebind.test 127.0.0.1",))
    try:
        browser.goto(f"http://127.0.0.1:{site.server_address[1]}/")  # another origin
        browser.eval(f"(attack({base!r}), true)")
        browser.wait("window.done === true", 30, "the page's requests")
        results = browser.eval("window.results")
        # the no-cors POSTs went out (an opaque answer), the JSON one was stopped by CORS
        assert [r[2] for r in results[:2]] == ["opaque", "opaque"], results
        assert results[2][2] == "error", results
        assert endpoint.recorder.held == 0  # nothing sampled, nothing recorded

        # DNS rebinding: the page's own name now points at this machine; the browser
        # sends same-origin requests with Host: rebind.test
        browser.goto(f"http://rebind.test:{endpoint.port}/ep/c1/v1/models")
        text = browser.eval("document.body.innerText")
        assert "is not a name of this server" in text and '"policy"' not in text, text

        # a program (the openai client) is served as before
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        answer = client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
        assert answer.choices and endpoint.recorder.held == 1
    finally:
        browser.close()
        site.shutdown()
        endpoint._server.should_exit = True  # its daemon thread ends
