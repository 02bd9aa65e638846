#!/usr/bin/env bash
# An unmodified third-party C project, built and tested with CC="lockstep cc": memcached
# from Debian's source package (issue 18). It checks that the toolchain takes real code
# as it is (GCC's always_inline refusal under -fgnu-tm, its TM crashes, libsei linked in
# place of libitm), not that memcached is hardened: it has no handler annotations.
# Takes a few minutes, so it is its own make target (`make sei-thirdparty`), not part
# of `make test`.
# Usage: scripts/sei_thirdparty.sh [WORKDIR]   (default build/thirdparty)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$root/build/thirdparty}
cd "$root"
scripts/deps.sh thirdparty
cargo build --release --locked -p lockstep-cli >/dev/null
export PATH="$root/target/release:$PATH"

mkdir -p "$work"
cd "$work"
# apt-get source unpacks memcached-<version>/ with Debian's patches applied; keep that
# pristine copy and build in a fresh one, so a rerun starts from the same sources.
if ! ls -d memcached-*/ >/dev/null 2>&1; then
    echo "sei-thirdparty: fetching memcached's Debian source package"
    apt-get source -qq memcached >/dev/null
fi
src=$(ls -d memcached-*/ | head -1)
src=${src%/}
rm -rf build-lockstep-cc
# cp -a keeps the timestamps; otherwise make believes configure.ac changed and wants automake
cp -a "$src" build-lockstep-cc
cd build-lockstep-cc
echo "sei-thirdparty: $src: ./configure CC=\"lockstep cc\""
./configure CC="lockstep cc" >configure.log 2>&1 || { tail -20 configure.log; exit 1; }
echo "sei-thirdparty: make"
make -j2 >make.log 2>&1 || { tail -40 make.log; exit 1; }
# The binary must carry libsei's TM ABI, not libitm's: lockstep cc linked it.
nm memcached >symbols.txt
if ! grep -q ' T _ITM_RU1$' symbols.txt; then
    echo "sei-thirdparty: memcached was not linked with libsei (no _ITM_RU1 defined)" >&2
    exit 1
fi
grep 'lockstep cc: ' make.log | sort -u | sed 's/^/  /' || true
echo "sei-thirdparty: make test (memcached's own suite)"
if ! make test >test.log 2>&1; then
    tail -40 test.log
    echo "sei-thirdparty: memcached's test suite FAILED under CC=\"lockstep cc\" ($work/build-lockstep-cc/test.log)" >&2
    exit 1
fi
grep -E '^(All tests successful|Files=)' test.log
echo "sei-thirdparty: $src configured, built and passed its own tests with CC=\"lockstep cc\""
