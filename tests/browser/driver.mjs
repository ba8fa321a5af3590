// A headless Chromium driven over stdin/stdout, one JSON command per line, for the Python
// tests (tests/helpers/browser.py). Debian's /usr/bin/chromium, started by playwright-core
// (which downloads nothing); no network but the page's own server.
//
//   node driver.mjs USER_DATA_DIR
//   {"cmd": "goto", "url": "..."}                       -> {"ok": true}
//   {"cmd": "wait", "js": "expr", "timeout_ms": 30000}  -> {"ok": true, "value": ...}
//   {"cmd": "eval", "js": "expr"}                       -> {"ok": true, "value": ...}
//   {"cmd": "screenshot", "path": "..."}                -> {"ok": true}
//   {"cmd": "errors"}                                   -> {"ok": true, "value": [...]}
//   {"cmd": "close"}                                    -> {"ok": true}, then exits
// A failure answers {"ok": false, "error": "..."}.
import readline from "node:readline";
import { chromium } from "playwright-core";

const ARGS = [
  "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
  "--disable-component-update", "--disable-quic", "--no-first-run", "--disable-sync",
  // more flags from the test (e.g. --host-resolver-rules to point a name at 127.0.0.1)
  ...JSON.parse(process.env.BROWSER_EXTRA_ARGS || "[]"),
];

const userDataDir = process.argv[2];
if (!userDataDir) {
  console.error("usage: node driver.mjs USER_DATA_DIR");
  process.exit(2);
}
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ARGS,
  viewport: { width: 1400, height: 1000 },
});
const page = context.pages()[0] || (await context.newPage());
const errors = [];
page.on("pageerror", (err) => errors.push(`pageerror: ${err.message}`));
page.on("console", (msg) => { if (msg.type() === "error") errors.push(`console: ${msg.text()}`); });
page.on("requestfailed", (req) => {
  // an EventSource closed by a run switch or the page's end is no failure of the page
  if (!req.url().includes("/events")) errors.push(`requestfailed: ${req.url()}`);
});

async function handle(cmd) {
  switch (cmd.cmd) {
    case "goto":
      await page.goto(cmd.url, { waitUntil: "load" });
      return null;
    case "wait": {
      const handle = await page.waitForFunction(cmd.js, null, { timeout: cmd.timeout_ms || 30000, polling: 200 });
      return await handle.jsonValue();
    }
    case "eval":
      return await page.evaluate(cmd.js);
    case "screenshot":
      await page.screenshot({ path: cmd.path, fullPage: true });
      return null;
    case "errors":
      return errors;
    case "close":
      await context.close();
      return null;
    default:
      throw new Error(`unknown command ${cmd.cmd}`);
  }
}

console.log(JSON.stringify({ ok: true, value: "ready" }));
const lines = readline.createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  let cmd;
  let reply;
  try {
    cmd = JSON.parse(line);
    reply = { ok: true, value: await handle(cmd) };
  } catch (err) {
    reply = { ok: false, error: String(err && err.message ? err.message : err) };
  }
  console.log(JSON.stringify(reply));
  if (cmd && cmd.cmd === "close") process.exit(0);
}
await context.close();
