# Sourced by the campaign drivers: a private copy of the release binary in $OUT, built
# once, so that rebuilding during a long evaluation does not mix versions; $OUT/commit
# records which commit it is. Sets L to the copy.
mkdir -p "$OUT"
if [ ! -x "$OUT/lockstep" ]; then
    cargo build --release --locked -q
    cp target/release/lockstep "$OUT/lockstep"
    git rev-parse --short HEAD > "$OUT/commit" 2>/dev/null || true
fi
L=$OUT/lockstep
