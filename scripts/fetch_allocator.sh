#!/usr/bin/env bash
# Best effort: put Debian's tcmalloc (libtcmalloc-minimal4, ~0.3 MB, no dependencies past libstdc++) into
# DEST (default .venv/lib/tandem-allocators), where runtime.allocator=auto finds it (tandem/runtime/allocator.py).
# Needs apt-get and dpkg-deb (Debian/Ubuntu); elsewhere, or offline, it says so and runs stay on glibc malloc.
set -u
dest=${1:-.venv/lib/tandem-allocators}
if ls "$dest"/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then exit 0; fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "fetch_allocator: no apt-get/dpkg-deb here; runs use glibc malloc (or install tcmalloc/jemalloc yourself)"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if (cd "$tmp" && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1 && dpkg-deb -x libtcmalloc-minimal4_*.deb x); then
    mkdir -p "$dest"
    cp -a "$tmp"/x/usr/lib/*/libtcmalloc_minimal.so.4* "$dest"/
    echo "fetch_allocator: tcmalloc in $dest"
else
    echo "fetch_allocator: could not download libtcmalloc-minimal4; runs use glibc malloc"
fi
exit 0
