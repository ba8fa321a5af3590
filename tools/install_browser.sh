#!/usr/bin/env bash
# Debian's Chromium for the browser tests (tests/e2e/test_dashboard.py), installed with
# apt-get when it is missing: as root, else through `sudo -n` (no password prompt); when
# neither can, nothing is installed (the tests then skip, except under CI=true). Says what
# it did. playwright-core drives it and downloads no browser: `npm ci --prefix
# tests/browser` installs that (it needs Node.js 20 or newer).
set -euo pipefail
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
  echo "install_browser: $CHROMIUM is there: nothing to do ($("$CHROMIUM" --version 2>/dev/null || echo 'version unknown'))"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install_browser: no $CHROMIUM and no apt-get: skipped (install Chromium, or set CHROMIUM)" >&2
  exit 0
fi
if [ "$(id -u)" = "0" ]; then
  as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "install_browser: no $CHROMIUM; not root and no password-less sudo: skipped" >&2
  exit 0
fi
how="apt-get as root"
[ "${#as_root[@]}" -gt 0 ] && how="sudo -n apt-get"
echo "install_browser: installing Debian's chromium with $how"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
echo "install_browser: installed $("$CHROMIUM" --version)"
