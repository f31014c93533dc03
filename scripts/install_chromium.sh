#!/usr/bin/env bash
# The browser test drives Debian's Chromium (Playwright's own browser download cannot work here).
# Installs it once; does nothing when it is already there.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
echo "installing Debian's chromium for the browser test (once)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
