#!/usr/bin/env bash
# Debian's Chromium for the browser tests (tests/e2e/test_dashboard.py), installed with
# apt-get when it is missing and this runs as root; otherwise nothing is done (the tests
# then skip, except under CI=true). playwright-core drives it and downloads no browser:
# `npm ci --prefix tests/browser` installs that.
set -euo pipefail
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  echo "install_browser: no $CHROMIUM, and not root with apt-get: skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium
"$CHROMIUM" --version
