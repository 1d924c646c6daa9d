#!/usr/bin/env bash
# Install bulwark as a systemd service: the binary, the unit template, the
# key-loading drop-in example and docs/service.md. Run as root:
#
#   cargo build --release
#   sudo ./scripts/install-service.sh
#   sudo systemctl enable --now bulwark@$(systemd-escape --path /srv/pool).service
#
# Options:
#   --bin PATH       the binary to install [default: target/release/bulwark]
#   --prefix DIR     where the binary and docs go [default: /usr/local]
#   --unit-dir DIR   where the unit goes [default: /etc/systemd/system]
#   --destdir DIR    stage everything under DIR (packaging); implies --no-reload
#   --no-reload      do not run 'systemctl daemon-reload'
# A --prefix other than /usr/local is written into the unit's ExecStart.
set -euo pipefail

cd "$(dirname "$0")/.."
bin=target/release/bulwark
prefix=/usr/local
unit_dir=/etc/systemd/system
destdir=""
reload=1
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin=$2; shift 2 ;;
        --prefix) prefix=$2; shift 2 ;;
        --unit-dir) unit_dir=$2; shift 2 ;;
        --destdir) destdir=$2; reload=0; shift 2 ;;
        --no-reload) reload=0; shift ;;
        -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "install-service.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$bin" ] || { echo "install-service.sh: $bin is not an executable; build it first (cargo build --release)" >&2; exit 1; }

install -D -m 0755 "$bin" "$destdir$prefix/bin/bulwark"
install -d -m 0755 "$destdir$unit_dir" "$destdir$prefix/share/doc/bulwark"
sed -e "s#/usr/local/bin/bulwark#$prefix/bin/bulwark#g" \
    -e "s#/usr/local/share/doc/bulwark#$prefix/share/doc/bulwark#g" \
    packaging/systemd/bulwark@.service > "$destdir$unit_dir/bulwark@.service"
chmod 0644 "$destdir$unit_dir/bulwark@.service"
sed -e "s#/usr/local/share/doc/bulwark#$prefix/share/doc/bulwark#g" \
    packaging/systemd/bulwark@.socket > "$destdir$unit_dir/bulwark@.socket"
chmod 0644 "$destdir$unit_dir/bulwark@.socket"
sed -e "s#/usr/local/bin/bulwark#$prefix/bin/bulwark#g" \
    packaging/systemd/keys.conf.example > "$destdir$prefix/share/doc/bulwark/keys.conf.example"
install -m 0644 docs/service.md "$destdir$prefix/share/doc/bulwark/service.md"

echo "installed $prefix/bin/bulwark and $unit_dir/bulwark@.service${destdir:+ under $destdir}"
if [ "$reload" -eq 1 ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
echo "start a pool: systemctl enable --now bulwark@\$(systemd-escape --path /srv/pool).socket bulwark@\$(systemd-escape --path /srv/pool).service"
