#!/usr/bin/env bash
# Debian packages holding the real text that `hf-specdec train eagle --real-text` builds prompts from
# (hf_specdec/training/text_sources.py): the Debian Administrator's Handbook in 26 languages, and fortune files in
# English, German, Spanish and Italian. Only needed to build training data, not to use or test the package.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debian-handbook fortunes fortunes-de fortunes-es fortunes-it
