#!/usr/bin/env bash
# Builds powerflex's Debian packages with cargo-deb (installed from crates.io when
# missing), into target/debian/ unless --out says otherwise:
#
#   powerflex-node        powerflexd, its unit and man page (depends on powerflex-cli)
#   powerflex-controller  powerflex-ctld and powerflex-grid, their units (depends on
#                         powerflex-cli)
#   powerflex-cli         powerflexctl, the SPANK plugin and its plugstack.conf.d line,
#                         /etc/slurm/powerflex.toml (both conffiles), the man pages
#                         powerflexctl(1) and powerflex.toml(5): what a login node needs
#
# Every binary's man page is written first from its own clap definitions
# (`--write-man-pages`), and powerflex.toml(5) from the config types
# (`powerflexctl reference config --format man`).
#
#   scripts/package.sh                       release build, then the three packages
#   scripts/package.sh --revision 2          the Debian revision (0.1.0-2)
#   scripts/package.sh --profile dev --no-build --out DIR
#                                            the test's packages, from the debug build the
#                                            suite already made (cargo-deb warns that it
#                                            is meant for release builds; it works)
#   scripts/package.sh --rpm                 the same three as RPMs instead, with
#                                            cargo-generate-rpm (installed when missing):
#                                            the Debian maintainer scripts as RPM
#                                            scriptlets, plugins in /usr/lib64/slurm
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh

profile=release
build=true
revision=1
out=
format=deb
while (($#)); do
    case "$1" in
    --profile) profile=${2:?--profile needs release or dev}; shift 2 ;;
    --no-build) build=false; shift ;;
    --revision) revision=${2:?--revision needs a number}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --rpm) format=rpm; shift ;;
    -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "package.sh: unknown argument $1; accepted: --profile release|dev, --no-build, --revision N, --out DIR, --rpm" >&2; exit 2 ;;
    esac
done
case "$profile" in
release) dir=target/release ;;
dev) dir=target/debug ;;
*) echo "package.sh: --profile $profile; accepted: release or dev" >&2; exit 2 ;;
esac
[[ $revision =~ ^[0-9]+$ ]] || { echo "package.sh: --revision $revision; accepted: a whole number" >&2; exit 2; }
[[ -n $out ]] || out=target/$([[ $format == rpm ]] && echo generate-rpm || echo debian)

command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
tool=$([[ $format == rpm ]] && echo "$POWERFLEX_CARGO_GENERATE_RPM" || echo "$POWERFLEX_CARGO_DEB")
if ! command -v "${tool%@*}" >/dev/null 2>&1; then
    echo "package.sh: installing $tool (cargo install, once)" >&2
    cargo install --quiet --locked "$tool"
fi

if $build; then
    echo "package.sh: building ($profile)" >&2
    cargo build --quiet --profile "$profile" -p powerflex-agent -p powerflex-spank \
        -p powerflex-controller -p powerflex-grid --bins --lib
fi
for part in powerflexd powerflex-ctld powerflex-grid powerflexctl libpower_flex.so; do
    [[ -f $dir/$part ]] || { echo "package.sh: $dir/$part is missing; build first (or leave out --no-build)" >&2; exit 1; }
done

# cargo-deb reads the man pages from target/man (the crates' asset lists).
rm -rf target/man
mkdir -p target/man
for bin in powerflexd powerflex-ctld powerflex-grid powerflexctl; do
    "$dir/$bin" --write-man-pages target/man >/dev/null
done
"$dir/powerflexctl" reference config --format man >target/man/powerflex.toml.5

mkdir -p "$out"
if [[ $format == rpm ]]; then
    # cargo-generate-rpm neither strips nor knows dpkg's words: stage stripped copies,
    # the plugstack line for RPM-based Slurm's plugin directory, and each Debian script
    # behind a line that maps RPM's count ($1: 1 install, 2+ upgrade in %post; 0 erase,
    # 1+ upgrade in %preun and %postun) to the word the script expects.
    stage=target/rpm-stage
    rm -rf "$stage"
    mkdir -p "$stage"
    for bin in powerflexd powerflex-ctld powerflex-grid powerflexctl; do
        strip --strip-debug -o "$stage/$bin" "$dir/$bin"
    done
    strip --strip-debug -o "$stage/power_flex.so" "$dir/libpower_flex.so"
    sed 's|/usr/lib/x86_64-linux-gnu/slurm-wlm/power_flex.so|/usr/lib64/slurm/power_flex.so|' \
        slurm-conf/plugstack.conf >"$stage/plugstack.conf"
    scriptlet() { # OUT MAPPING DEBIAN-SCRIPT
        { echo '#!/bin/sh'; echo "# $3 as an RPM scriptlet (scripts/package.sh)."; echo "$2"; tail -n +2 "$3"; } >"$stage/$1"
    }
    post='if [ "$1" -ge 2 ]; then set -- configure rpm-upgrade; else set -- configure ""; fi'
    preun='if [ "$1" -eq 0 ]; then set -- remove; else set -- upgrade; fi'
    postun='if [ "$1" -eq 0 ]; then set -- purge; else set -- upgrade; fi'
    # A failed %post does not undo an RPM upgrade: what to run once the file is mended.
    retry_node='POWERFLEX_RETRY="systemctl try-restart powerflexd"'
    retry_controller='POWERFLEX_RETRY="systemctl try-restart powerflex-ctld powerflex-grid"'
    for role in node controller; do
        retry=retry_$role
        scriptlet "$role-post.sh" "${!retry}; $post" "packaging/$role/postinst"
        scriptlet "$role-preun.sh" "$preun" "packaging/$role/prerm"
        scriptlet "$role-postun.sh" "$postun" "packaging/$role/postrm"
    done
    make_rpm() {
        cargo generate-rpm --auto-req no -s "release = \"$revision\"" -o "$out" "$@" >&2
    }
    rm -f "$out"/powerflex-{node,controller,cli}-*.rpm
    make_rpm -p agent
    make_rpm -p controller
    make_rpm -p controller --variant server
    for name in powerflex-node powerflex-controller powerflex-cli; do
        f=$(ls "$out/$name"-[0-9]*-"$revision".*.rpm 2>/dev/null | head -1)
        [[ -n $f ]] || { echo "package.sh: no $name RPM was made in $out" >&2; exit 1; }
        echo "$f"
    done
    exit 0
fi
version=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"]=="powerflex-agent"))')
# No package of an earlier run can pass for this one's.
for name in powerflex-node powerflex-controller powerflex-cli; do
    rm -f "$out/${name}_${version}-${revision}_amd64.deb"
done
# cargo-deb's own status decides (pipefail); only its known notes about the dev
# profile and the man pages' paths are filtered out of what it says.
deb() {
    cargo deb --quiet --no-build --profile "$profile" --deb-revision "$revision" -o "$out" "$@" 2>&1 \
        | { grep -v -e 'dev profile is not supported' -e 'To enable debug symbols' -e 'does not match the pattern' || true; } >&2
}
deb -p powerflex-agent
deb -p powerflex-controller
deb -p powerflex-controller --variant server
for name in powerflex-node powerflex-controller powerflex-cli; do
    f="$out/${name}_${version}-${revision}_amd64.deb"
    [[ -f $f ]] || { echo "package.sh: $f was not made" >&2; exit 1; }
    echo "$f"
done
