# Shared by scripts/test.sh and scripts/demo.sh: install what bulwark, its
# build and its tests need, when it is missing (Debian). Source it; it sets
# SUDO and PATH and defines log().
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

log() { printf '==> %s\n' "$*"; }

# --- system packages -------------------------------------------------------
need_pkgs=()
have() { command -v "$1" >/dev/null 2>&1; }
have qemu-io        || need_pkgs+=(qemu-utils)
have qemu-img       || need_pkgs+=(qemu-utils)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
installed qemu-block-extra   || need_pkgs+=(qemu-block-extra)
installed qemu-system-common || need_pkgs+=(qemu-system-common)
have nbdinfo        || need_pkgs+=(libnbd-bin)
have nbdcopy        || need_pkgs+=(libnbd-bin)
have nbdfuse        || need_pkgs+=(libnbd-bin)
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || need_pkgs+=(python3-libnbd)
# tests/helpers/bwforge.py opens the volume table (AES-256-GCM) as an attacker would
/usr/bin/python3 -c 'import cryptography' >/dev/null 2>&1 || need_pkgs+=(python3-cryptography)
have nbdkit         || need_pkgs+=(nbdkit)
have fio            || need_pkgs+=(fio)
have fusermount3    || need_pkgs+=(fuse3)
have mkfs.ext4      || need_pkgs+=(e2fsprogs)
have e2fsck         || need_pkgs+=(e2fsprogs)
have pkg-config     || need_pkgs+=(pkg-config)
have cc             || need_pkgs+=(build-essential)
installed libssl-dev || need_pkgs+=(libssl-dev)
have openssl        || need_pkgs+=(openssl)   # TLS tests make their CA and certificates
have systemd-analyze || need_pkgs+=(systemd)  # the unit file is checked with 'systemd-analyze verify'
# tests/test_clone_boots.py boots a clone under qemu: the emulator, a kernel
# (the cloud flavour: a third of the generic one's size) and a static busybox
# for tests/helpers/make_boot_image.py to build the guest from.
# Best effort: a kernel package's install hooks may fail on some machines; the boot
# test then skips, naming what is missing, and nothing else depends on these.
boot_pkgs=()
have qemu-system-x86_64 || boot_pkgs+=(qemu-system-x86)
have_kernel() {  # a /boot/vmlinuz-VERSION with its /lib/modules/VERSION
    local k
    for k in /boot/vmlinuz-*; do
        [ -r "$k" ] && [ -e "/lib/modules/${k#/boot/vmlinuz-}/modules.dep" ] && return 0
    done
    return 1
}
have_kernel         || boot_pkgs+=(linux-image-cloud-amd64)
installed busybox-static || boot_pkgs+=(busybox-static)
have prometheus     || need_pkgs+=(prometheus)  # tests/test_metrics.py scrapes serve --metrics-listen with it
if [ ${#need_pkgs[@]} -gt 0 ] || [ ${#boot_pkgs[@]} -gt 0 ]; then
    $SUDO apt-get update -q
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
    # shellcheck disable=SC2207
    pkgs=($(printf '%s\n' "${need_pkgs[@]}" | sort -u))
    log "installing ${pkgs[*]}"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${pkgs[@]}"
fi
if [ ${#boot_pkgs[@]} -gt 0 ]; then
    log "installing ${boot_pkgs[*]} (for tests/test_clone_boots.py; it skips without them)"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${boot_pkgs[@]}" \
        || log "warning: could not install ${boot_pkgs[*]}: tests/test_clone_boots.py will skip"
fi

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

