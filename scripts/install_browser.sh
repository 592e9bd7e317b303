#!/usr/bin/env bash
# Headless Chromium for the demo's browser test (tests/integration/test_demo_browser.py): Debian's chromium and
# chromium-driver packages. Idempotent: does nothing when /usr/bin/chromium is already there.
# Playwright drives it through executable_path, so no browser download is needed (pip install '.[demo]').
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "chromium already installed: $(command -v chromium)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y chromium chromium-driver
echo "installed: $(command -v chromium)"
