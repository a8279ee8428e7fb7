#!/usr/bin/env bash
# bubblewrap for the code reward's sandbox (docs/security.md): installed when missing, if this user
# can (root with apt-get). Never fatal: without it the code reward refuses to run and the sandbox's
# isolation tests skip, naming bubblewrap.
command -v bwrap >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap) >/dev/null 2>&1 \
    || echo "could not install bubblewrap: the code sandbox's isolation tests will skip" >&2
else
  echo "bubblewrap (bwrap) is missing and needs root + apt-get to install: the code sandbox's isolation tests will skip" >&2
fi
exit 0
