# Sourced by setup.sh and setup_bench.sh: install into the project's venv with uv
# (https://github.com/astral-sh/uv), from exactly the places pip is configured to use on this
# machine (its find-links, index, extra indexes, constraint file and CA bundle).
#
# Why uv and not pip: the same packages at the same versions (checked against pip's freeze of
# setup.sh's install, 204 of 204 equal), setup.sh in 78 s with uv's cache cold and 65 s warm
# (bytecode compiled in both, most of it), against 213 s with pip (2026-12-06, this 2-core
# machine). pip here re-downloads everything on every run (its HTTP cache stays empty behind
# the registry) and one file at a time; uv downloads in parallel and keeps its wheel cache.
# `--index-strategy unsafe-best-match` is pip's own rule: the best version over every index, not
# the first index that has the package.
#
# Needs ROOT (the repository) and VENV set to a venv that exists. `uv_bootstrap` first: it
# installs uv from pip (pinned, once per venv) and reads pip's sources once for every
# `uv_install` after it.

UV_VERSION="0.13.9"

# The stamp of a setup's inputs, kept in the venv to make a second run with nothing changed a
# no-op: the shared scripts, pyproject.toml and requirements/, plus what the caller adds (its own
# script, its options).
inputs_stamp() {
    cat "$ROOT/scripts/setup.sh" "$ROOT/scripts/uv_install.sh" "$ROOT/pyproject.toml" \
        "$ROOT"/requirements/*.txt "$@" | sha256sum | cut -d' ' -f1
}

uv_bootstrap() {
    if [[ "$("$VENV/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
        "$VENV/bin/python" -m pip --disable-pip-version-check -q install "uv==$UV_VERSION" \
            2> >(grep --line-buffered -v "WARNING: Location 'file:" >&2)
    fi
    mapfile -t UV_SOURCES < <(uv_sources)
    local cert="${SSL_CERT_FILE:-${PIP_CERT:-}}"
    [[ -n "$cert" ]] ||
        cert="$("$VENV/bin/python" -m pip config get global.cert 2>/dev/null || true)"
    UV_TLS=()
    [[ -z "$cert" ]] || UV_TLS=("SSL_CERT_FILE=$cert")
}

# pip's configured sources (files and PIP_* variables, as `pip config list` shows them) as uv
# options, one per line. Local stores that do not exist are left out, as pip skips them.
uv_sources() {
    local line key value item
    "$VENV/bin/python" -m pip config list 2>/dev/null | while IFS= read -r line; do
        key="${line%%=*}"
        key="${key##*.}"
        value="${line#*=}"
        value="${value#\'}"
        value="${value%\'}"
        case "$key" in
            find-links | extra-index-url | index-url | constraint) ;;
            *) continue ;;
        esac
        for item in $value; do
            local path="${item#file://}"
            if [[ "$item" == /* || "$item" == file://* ]] && [[ ! -e "$path" ]]; then
                continue
            fi
            printf -- '--%s\n%s\n' "$key" "$item"
        done
    done
}

# `uv pip install ARGS` into VENV from pip's sources (read by uv_bootstrap); pip's CA bundle,
# when it names one, is the one uv trusts too. Bytecode is compiled at install, as pip does:
# where PYTHONDONTWRITEBYTECODE is set (it is on our CI machines) nothing would ever write it, and
# every process would compile torch, transformers and ray from source at each start (a Ray
# role then took 45-60 s to come up instead of seconds).
uv_install() {
    env "${UV_TLS[@]}" "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" \
        --compile-bytecode --index-strategy unsafe-best-match "${UV_SOURCES[@]}" "$@"
}

uv_uninstall() {
    "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" "$@" >/dev/null 2>&1 || true
}
