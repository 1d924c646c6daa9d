# Shared by scripts/test.sh and scripts/demo.sh: install what bulwark's build
# and the demo need, when it is missing (Debian); install_test_packages (called
# by test.sh only) adds what the tests need. Source it; it sets SUDO and PATH
# and defines log().
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

log() { printf '==> %s\n' "$*"; }

# --- system packages -------------------------------------------------------
# Sourcing this installs only what building bulwark and scripts/demo.sh need;
# scripts/test.sh then calls install_test_packages for the test suite's tools.
have() { command -v "$1" >/dev/null 2>&1; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
apt_updated=""
apt_install() {  # PKG... (deduplicated; apt-get update once per run)
    [ $# -gt 0 ] || return 0
    # shellcheck disable=SC2207
    local pkgs=($(printf '%s\n' "$@" | sort -u))
    if [ -z "$apt_updated" ]; then $SUDO apt-get update -q; apt_updated=1; fi
    log "installing ${pkgs[*]}"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${pkgs[@]}"
}

# The build, and the demo: nbdfuse, FUSE and mkfs.ext4 (the loop mount is util-linux's).
need_pkgs=()
have pkg-config     || need_pkgs+=(pkg-config)
have cc             || need_pkgs+=(build-essential)
installed libssl-dev || need_pkgs+=(libssl-dev)
have nbdfuse        || need_pkgs+=(libnbd-bin)
have fusermount3    || need_pkgs+=(fuse3)
have mkfs.ext4      || need_pkgs+=(e2fsprogs)
apt_install "${need_pkgs[@]}"

# What only the tests need (scripts/test.sh).
install_test_packages() {
    local need_pkgs=()
    have qemu-io        || need_pkgs+=(qemu-utils)
    have qemu-img       || need_pkgs+=(qemu-utils)
    installed qemu-block-extra   || need_pkgs+=(qemu-block-extra)
    installed qemu-system-common || need_pkgs+=(qemu-system-common)
    have nbdinfo        || need_pkgs+=(libnbd-bin)
    have nbdcopy        || need_pkgs+=(libnbd-bin)
    /usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || need_pkgs+=(python3-libnbd)
    # tests/helpers/bwforge.py opens the volume table (AES-256-GCM) as an attacker would
    /usr/bin/python3 -c 'import cryptography' >/dev/null 2>&1 || need_pkgs+=(python3-cryptography)
    have nbdkit         || need_pkgs+=(nbdkit)
    have fio            || need_pkgs+=(fio)
    have mkfs.xfs       || need_pkgs+=(xfsprogs)   # the CSI driver formats ext4 or xfs (tests/test_csi_*.py)
    have e2fsck         || need_pkgs+=(e2fsprogs)
    have openssl        || need_pkgs+=(openssl)   # TLS tests make their CA and certificates
    have systemd-analyze || need_pkgs+=(systemd)  # the unit file is checked with 'systemd-analyze verify'
    have prometheus     || need_pkgs+=(prometheus)  # tests/test_metrics.py scrapes serve --metrics-listen with it
    # tests/test_proxmox_plugin.py runs the Proxmox VE plugin (Perl, JSON)
    have perl           || need_pkgs+=(perl)
    perl -MJSON -e 1 >/dev/null 2>&1 || need_pkgs+=(libjson-perl)
    apt_install "${need_pkgs[@]}"
    # tests/test_clone_boots.py boots a clone under qemu: the emulator, a kernel
    # (the cloud flavour: a third of the generic one's size) and a static busybox
    # for tests/helpers/make_boot_image.py to build the guest from.
    # Best effort: a kernel package's install hooks may fail on some machines; the boot
    # test then skips, naming what is missing, and nothing else depends on these.
    local boot_pkgs=()
    have qemu-system-x86_64 || boot_pkgs+=(qemu-system-x86)
    have_kernel         || boot_pkgs+=(linux-image-cloud-amd64)
    installed busybox-static || boot_pkgs+=(busybox-static)
    if [ ${#boot_pkgs[@]} -gt 0 ]; then
        log "(for tests/test_clone_boots.py; it skips without them)"
        apt_install "${boot_pkgs[@]}" \
            || log "warning: could not install ${boot_pkgs[*]}: tests/test_clone_boots.py will skip"
    fi
}
have_kernel() {  # a /boot/vmlinuz-VERSION with its /lib/modules/VERSION
    local k
    for k in /boot/vmlinuz-*; do
        [ -r "$k" ] && [ -e "/lib/modules/${k#/boot/vmlinuz-}/modules.dep" ] && return 0
    done
    return 1
}

# --- Rust --------------------------------------------------------------------
if ! have cargo; then
    export PATH="$HOME/.cargo/bin:$PATH"
    if ! have cargo; then
        log "installing Rust with rustup"
        if have rustup; then
            rustup default stable
        else
            have curl || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends curl ca-certificates; }
            curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
        fi
    fi
fi


# --- object-store test servers (tests/helpers/s3servers.py) ------------------
# moto's server (moto[server], which brings boto3) for the Python that runs
# pytest, and versitygw, pinned, built with `go install`. Each is skipped when
# present; a test whose server is missing skips, naming it. versitygw v1.8.0
# needs Go >= 1.25: a Go >= 1.21 fetches that toolchain itself through the Go
# module proxy (GOTOOLCHAIN=auto); Debian bookworm's golang-go is 1.19, too old,
# so without a newer Go (e.g. /usr/local/go) the versitygw tests skip.
MOTO_SPEC='moto[server]==5.2.1'
VERSITYGW_VERSION=v1.8.0
go_minor() {  # "go version go1.26.8 linux/amd64" -> 26
    "$1" version 2>/dev/null | sed -n 's/^go version go1\.\([0-9]*\).*/\1/p'
}
install_object_store_test_deps() {  # $1: the Python that runs pytest
    local py=$1 go="" gobin
    if ! "$py" -c 'import moto.server, flask, boto3' >/dev/null 2>&1; then
        log "installing $MOTO_SPEC for $py"
        if ! "$py" -m pip --version >/dev/null 2>&1; then
            $SUDO apt-get update -q
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends python3-pip
        fi
        "$py" -m pip install -q "$MOTO_SPEC" 2>/dev/null \
            || "$py" -m pip install -q --break-system-packages "$MOTO_SPEC" \
            || log "warning: could not install $MOTO_SPEC: the moto object-store tests will skip"
    fi

    if have go; then go=$(command -v go); elif [ -x /usr/local/go/bin/go ]; then go=/usr/local/go/bin/go; fi
    if [ -n "$go" ]; then
        gobin=$("$go" env GOBIN); [ -n "$gobin" ] || gobin="$("$go" env GOPATH | cut -d: -f1)/bin"
    else
        gobin=$HOME/go/bin
    fi
    case ":$PATH:" in *":$gobin:"*) ;; *) export PATH="$PATH:$gobin" ;; esac
    local vgw
    vgw=$(command -v versitygw || true)
    if [ -n "$vgw" ] && grep -aq "mod	github.com/versity/versitygw	$VERSITYGW_VERSION	" "$vgw"; then
        return 0
    fi
    if [ -z "$go" ]; then
        local cand
        cand=$(apt-cache policy golang-go 2>/dev/null | sed -n 's/^ *Candidate: *[0-9]*:*1\.\([0-9]*\).*/\1/p')
        if [ -n "$cand" ] && [ "$cand" -ge 21 ]; then
            log "installing golang-go (Go 1.$cand) to build versitygw"
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends golang-go \
                && go=$(command -v go)
        fi
    fi
    if [ -z "$go" ] || [ "$(go_minor "$go")" -lt 21 ]; then
        log "warning: no Go >= 1.21 (Debian bookworm's golang-go is 1.19): versitygw $VERSITYGW_VERSION" \
            "is not built and the versitygw object-store tests will skip"
        return 0
    fi
    log "go install github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION (into $gobin)"
    GOTOOLCHAIN=auto "$go" install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION" \
        || log "warning: could not build versitygw $VERSITYGW_VERSION: the versitygw object-store tests will skip"
}


# --- CSI conformance (tests/test_csi_sanity.py, tests/test_csi_keys.py) ----------
# csi-sanity from kubernetes-csi/csi-test v5, built with `go install` (about 2 min),
# and grpcio + grpcio-tools for the Python that runs pytest (the tests' own gRPC
# client, compiled from crates/csi/proto/csi.proto). Each is skipped when present;
# without them the CSI tests skip, naming what is missing.
CSI_SANITY_VERSION=v5.6.0
install_csi_test_deps() {  # $1: the Python that runs pytest
    local py=$1 go="" gobin
    if ! "$py" -c 'import grpc, grpc_tools' >/dev/null 2>&1; then
        log "installing grpcio and grpcio-tools for $py"
        "$py" -m pip install -q grpcio grpcio-tools 2>/dev/null \
            || "$py" -m pip install -q --break-system-packages grpcio grpcio-tools \
            || log "warning: could not install grpcio: tests/test_csi_keys.py will skip"
    fi
    if have go; then go=$(command -v go); elif [ -x /usr/local/go/bin/go ]; then go=/usr/local/go/bin/go; fi
    if [ -z "$go" ]; then
        log "warning: no Go: csi-sanity is not built and tests/test_csi_sanity.py will skip"
        return 0
    fi
    gobin=$("$go" env GOBIN); [ -n "$gobin" ] || gobin="$("$go" env GOPATH | cut -d: -f1)/bin"
    case ":$PATH:" in *":$gobin:"*) ;; *) export PATH="$PATH:$gobin" ;; esac
    local cs
    cs=$(command -v csi-sanity || true)
    if [ -n "$cs" ] && grep -aq "mod	github.com/kubernetes-csi/csi-test/v5	$CSI_SANITY_VERSION	" "$cs"; then
        return 0
    fi
    log "go install github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_SANITY_VERSION (into $gobin)"
    GOTOOLCHAIN=auto "$go" install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_SANITY_VERSION" \
        || log "warning: could not build csi-sanity: tests/test_csi_sanity.py will skip"
}
