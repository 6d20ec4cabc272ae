"""Hardware fact collection on a node: one POSIX shell script, one SSH round trip.

The script is what the server sends over SSH to nodes that have no agent installed; the agent
runs the same script locally (``collect_local``), so both paths produce the same text and
``bcm.domain.facts.parse_fact_output`` is the only parser. Standard library only: this module
ships inside node images that may have nothing but python3.

Output format (line oriented, stable; bump ``FACT_FORMAT_VERSION`` when it changes)::

    @@@ bcm-facts 1
    @@@ begin <section>
    <raw command output>
    @@@ end <section> rc=<exit status>        or        @@@ end <section> missing=<tool>

A section whose tool is absent is still emitted (empty, with ``missing=``), so the parser can
tell "not installed" from "installed but failed" from "output lost".
"""

from __future__ import annotations

import subprocess

FACT_FORMAT_VERSION = 1
SECTION_PREFIX = "@@@ "

# Every command runs under `timeout` where available: one wedged tool (ipmitool against a dead
# BMC, nvidia-smi against a hung driver) must cost one section, not the whole report.
FACT_SCRIPT = r"""
export LC_ALL=C
PATH="$PATH:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export PATH
if command -v timeout >/dev/null 2>&1; then _bcm_t="timeout 30"; else _bcm_t=""; fi
_bcm_rc=0

_bcm_begin() { printf '@@@ begin %s\n' "$1"; }
_bcm_end() { printf '\n@@@ end %s rc=%s\n' "$1" "$2"; }
_bcm_missing() { _bcm_rc=127; printf '\n@@@ end %s missing=%s\n' "$1" "$2"; }

# _bcm_run SECTION STDERR(drop|keep) COMMAND [ARGS...]
_bcm_run() {
    _bcm_name=$1; _bcm_err=$2; shift 2
    _bcm_begin "$_bcm_name"
    if ! command -v "$1" >/dev/null 2>&1; then _bcm_missing "$_bcm_name" "$1"; return; fi
    if [ "$_bcm_err" = keep ]; then $_bcm_t "$@" 2>&1; else $_bcm_t "$@" 2>/dev/null; fi
    _bcm_rc=$?
    _bcm_end "$_bcm_name" "$_bcm_rc"
}

printf '@@@ bcm-facts 1\n'
_bcm_run hostname drop hostname
_bcm_run kernel drop uname -r

_bcm_run lscpu drop lscpu -J
if [ "$_bcm_rc" != 0 ]; then _bcm_run cpuinfo drop cat /proc/cpuinfo; fi

_bcm_run meminfo drop cat /proc/meminfo
_bcm_run lsblk drop lsblk -J -b -d -o NAME,SIZE,TYPE,MODEL,SERIAL,ROTA,TRAN
_bcm_run iplink drop ip -j link
_bcm_run ipaddr drop ip -j addr

# name, MAC, operstate, speed (Mb/s; empty or -1 when unknown), mtu, 1 if backed by a device
_bcm_begin netsys
for _d in /sys/class/net/*; do
    [ -e "$_d" ] || continue
    if [ -e "$_d/device" ]; then _bcm_phys=1; else _bcm_phys=0; fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "${_d##*/}" "$(cat "$_d/address" 2>/dev/null)" \
        "$(cat "$_d/operstate" 2>/dev/null)" "$(cat "$_d/speed" 2>/dev/null)" \
        "$(cat "$_d/mtu" 2>/dev/null)" "$_bcm_phys"
done
_bcm_end netsys 0

if [ -r /etc/os-release ]; then _bcm_run osrelease drop cat /etc/os-release
else _bcm_run osrelease drop cat /usr/lib/os-release; fi

_bcm_begin dmi
if [ -d /sys/class/dmi/id ]; then
    for _k in sys_vendor product_name product_serial board_vendor board_name bios_version; do
        [ -r "/sys/class/dmi/id/$_k" ] && printf '%s=%s\n' "$_k" "$(cat "/sys/class/dmi/id/$_k" 2>/dev/null)"
    done
    _bcm_end dmi 0
elif command -v dmidecode >/dev/null 2>&1; then
    for _p in sys_vendor:system-manufacturer product_name:system-product-name \
              product_serial:system-serial-number board_vendor:baseboard-manufacturer \
              board_name:baseboard-product-name bios_version:bios-version; do
        printf '%s=%s\n' "${_p%%:*}" "$($_bcm_t dmidecode -s "${_p#*:}" 2>/dev/null | head -n 1)"
    done
    _bcm_end dmi 0
else
    _bcm_missing dmi dmidecode
fi

_bcm_run lspci drop lspci -Dnnmm
_bcm_run nvidiasmi keep nvidia-smi \
    --query-gpu=index,uuid,name,memory.total,serial,pci.bus_id,driver_version,vbios_version \
    --format=csv,noheader,nounits
_bcm_run ipmilan keep ipmitool lan print
exit 0
"""


def collect_local(timeout_s: float = 120.0) -> str:
    """Run FACT_SCRIPT on this machine (the agent's path) and return its sectioned output."""
    done = subprocess.run(
        ["/bin/sh", "-c", FACT_SCRIPT],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        check=False,
    )
    return done.stdout
