#!/usr/bin/env bash
# Runs a Linux x86-64 program on an emulated Sapphire Rapids (AMX-TILE, AMX-BF16, AMX-INT8,
# AVX-512) and exits with the program's status: the AMX kernels' tests run here on CPUs without
# AMX, as they would on a Xeon that has it.
#
#   scripts/amx-emulator.sh PROGRAM [ARGS...]
#   scripts/amx-emulator.sh --prepare        # build and fetch everything, run nothing
#   scripts/amx-emulator.sh --install-tools  # only install the Debian packages it uses (root)
#
# The emulator is Bochs 3.0 (Debian's source package) with scripts/amx-emulator/bochs-3.0-amx.patch,
# booting Debian's current kernel from a CD image whose initramfs holds busybox, PROGRAM and the
# shared libraries it links. PROGRAM's output comes back on the emulated serial port. Everything
# is built once into $RECSYS_AMX_EMULATOR_DIR (default ~/.cache/recsys/amx-emulator): about 3
# minutes on 2 cores the first time; a run boots in about 25 seconds and then runs PROGRAM at
# roughly 100-200 million instructions a second (keep the tested shapes small).
#
# Environment: RECSYS_AMX_EMULATOR_DIR (the build cache), RECSYS_AMX_EMULATOR_TIMEOUT (seconds a
# run may take, default 900), RECSYS_AMX_EMULATOR_MEGS (guest memory, default 1024).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 PROGRAM [ARGS...] | --prepare" >&2
  exit 2
fi
prepare_only=0
tools_only=0
if [[ $1 == --prepare ]]; then
  prepare_only=1
elif [[ $1 == --install-tools ]]; then
  tools_only=1
else
  program=$(readlink -f "$1")
  shift
  if [[ ! -x "$program" ]]; then
    echo "amx-emulator: $program is not an executable file" >&2
    exit 2
  fi
fi

here=$(cd "$(dirname "$0")" && pwd)
cache=${RECSYS_AMX_EMULATOR_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/recsys/amx-emulator}
timeout_s=${RECSYS_AMX_EMULATOR_TIMEOUT:-900}
megs=${RECSYS_AMX_EMULATOR_MEGS:-1024}
mkdir -p "$cache"
log() { echo "amx-emulator: $*" >&2; }

# Debian's package lists beside the system's own, in the cache: trixie for Bochs 3.0's source,
# sid for the current kernel (AMX needs Linux 5.16 or later; 6.1 hangs in this emulator).
apt_for() {
  local suite=$1 dir="$cache/apt-$1"
  if [[ ! -f "$dir/updated" ]]; then
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    printf 'deb http://deb.debian.org/debian %s main\ndeb-src http://deb.debian.org/debian %s main\n' \
      "$suite" "$suite" >"$dir/sources.list"
    apt-get -q -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
      -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" update >"$dir/update.log" 2>&1 ||
      { log "apt-get update for $suite failed: $dir/update.log"; exit 1; }
    touch "$dir/updated"
  fi
  echo -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
    -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache"
}

# The host tools: the ISO's boot loader and writer, the initramfs's archiver and shell, the
# emulator's BIOS images, a C++ compiler for Bochs.
need=()
[[ -f /usr/lib/ISOLINUX/isolinux.bin ]] || need+=(isolinux)
[[ -f /usr/lib/syslinux/modules/bios/ldlinux.c32 ]] || need+=(syslinux-common)
command -v xorriso >/dev/null || need+=(xorriso)
command -v cpio >/dev/null || need+=(cpio)
[[ -x /bin/busybox ]] || need+=(busybox-static)
[[ -f /usr/share/bochs/BIOS-bochs-latest ]] || need+=(bochsbios)
[[ -f /usr/share/vgabios/vgabios.bin ]] || need+=(vgabios)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
if [[ ${#need[@]} -gt 0 ]]; then
  log "installing ${need[*]}"
  if [[ $(id -u) -ne 0 ]]; then
    log "not root: install ${need[*]} first"
    exit 1
  fi
  apt-get install -y -q "${need[@]}" >"$cache/apt-install.log" 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${need[@]}" >"$cache/apt-install.log" 2>&1; } ||
    { log "apt-get install failed: $cache/apt-install.log"; exit 1; }
fi

if [[ $tools_only -eq 1 ]]; then
  exit 0
fi

# Bochs 3.0 with AMX and the XFD patch, built once.
bochs="$cache/bochs-3.0/bochs"
patch_file="$here/amx-emulator/bochs-3.0-amx.patch"
patch_sum=$(sha256sum "$patch_file" | cut -c1-16)
if [[ ! -x "$bochs" || "$(cat "$cache/bochs-3.0/.patch" 2>/dev/null)" != "$patch_sum" ]]; then
  log "building Bochs 3.0 with AMX (once, about 3 minutes)"
  read -r -a apt_trixie <<<"$(apt_for trixie)"
  src="$cache/src"
  rm -rf "$src" "$cache/bochs-3.0"
  mkdir -p "$src"
  # Only the upstream tarball is used (Debian's packaging is not).
  (cd "$src" && apt-get -q "${apt_trixie[@]}" source --download-only bochs >"$cache/source.log" 2>&1) || true
  tarball=$(ls "$src"/bochs_3.0*.orig.tar.* 2>/dev/null | head -1)
  if [[ -z "$tarball" ]]; then
    log "no Bochs 3.0 source from Debian trixie: $cache/source.log"
    exit 1
  fi
  tar xf "$tarball" -C "$cache"
  (cd "$cache/bochs-3.0" && patch -p1 <"$patch_file" >/dev/null)
  (cd "$cache/bochs-3.0" &&
    ./configure --enable-x86-64 --enable-cpu-level=6 --enable-avx --enable-evex --enable-amx \
      --enable-all-optimizations --enable-a20-pin --enable-pci --enable-cdrom --enable-fpu \
      --disable-plugins --with-nogui --without-x11 --without-x --disable-usb \
      >"$cache/configure.log" 2>&1 &&
    make -j"$(nproc)" >"$cache/make.log" 2>&1) ||
    { log "building Bochs failed: $cache/configure.log, $cache/make.log"; exit 1; }
  echo "$patch_sum" >"$cache/bochs-3.0/.patch"
fi

# Debian's current kernel (sid's linux-image-amd64 names it; its vmlinuz is in linux-binary-*).
kernel="$cache/vmlinuz"
if [[ ! -f "$kernel" ]]; then
  read -r -a apt_sid <<<"$(apt_for sid)"
  image=$(apt-cache "${apt_sid[@]}" depends linux-image-amd64 2>/dev/null |
    grep -o 'linux-image-[0-9][^ ]*-amd64' | head -1)
  if [[ -z "$image" ]]; then
    log "cannot name Debian sid's current kernel (apt-cache depends linux-image-amd64)"
    exit 1
  fi
  version=${image#linux-image-}
  log "fetching Linux $version"
  work=$(mktemp -d)
  (cd "$work" && apt-get -q "${apt_sid[@]}" download "linux-binary-$version" >"$cache/kernel.log" 2>&1) ||
    { log "downloading linux-binary-$version failed: $cache/kernel.log"; exit 1; }
  dpkg-deb --fsys-tarfile "$work"/linux-binary-*.deb | tar x -C "$work" --wildcards '*/vmlinuz'
  cp "$(find "$work" -name vmlinuz | head -1)" "$kernel"
  rm -rf "$work"
fi

if [[ $prepare_only -eq 1 ]]; then
  log "ready: $bochs, $kernel"
  exit 0
fi

# This run's initramfs: busybox, the program and its libraries, an init that runs it and powers
# the machine off.
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
root="$run/root"
mkdir -p "$root"/{bin,dev,proc,sys,tmp,run}
cp /bin/busybox "$root/bin/busybox"
# At a path of its own (the guest mounts a fresh /tmp over whatever the program's path was).
guest_program="/test/$(basename "$program")"
mkdir -p "$root/test"
cp "$program" "$root$guest_program"
# (A static program has none: ldd fails on it.)
{ ldd "$program" 2>/dev/null || true; } | { grep -o '/[^ ]*' || true; } | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
args=$(printf ' %q' "$@")
cat >"$root/init" <<EOF
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox mount -t tmpfs tmp /tmp
cd /tmp
echo "amx-emulator: cpu flags: \$(/bin/busybox grep -o 'amx[a-z0-9_]*' /proc/cpuinfo | /bin/busybox sort -u | /bin/busybox tr '\n' ' ')"
HOME=/tmp RUST_BACKTRACE=1 $(printf '%q' "$guest_program")$args
echo "amx-emulator: exit status \$?"
# The console writes to the serial port asynchronously: power off before it drains and the
# status line is cut short (seen once a test binary ran a little longer), so wait for it.
/bin/busybox sleep 1
/bin/busybox sync
/bin/busybox poweroff -f
EOF
chmod +x "$root/init"
mkdir -p "$run/iso"
(cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1 >"$run/iso/initrd.img")
cp "$kernel" "$run/iso/vmlinuz"
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 "$run/iso/"
# hpet=disable: Bochs's HPET gives Linux a zero clock rate; no5lvl, ibt=off: features the
# emulated CPU offers that this kernel trips on in it.
cat >"$run/iso/isolinux.cfg" <<'EOF'
default linux
prompt 0
timeout 0
label linux
  kernel /vmlinuz
  append initrd=/initrd.img console=ttyS0,115200 quiet mitigations=off nokaslr tsc=reliable panic=-1 hpet=disable no5lvl ibt=off rdinit=/init
EOF
xorriso -as mkisofs -quiet -o "$run/boot.iso" -b isolinux.bin -c boot.cat -no-emul-boot \
  -boot-load-size 4 -boot-info-table "$run/iso" 2>/dev/null
cat >"$run/bochsrc" <<EOF
megs: $megs
cpu: model=sapphire_rapids, count=1, ips=200000000
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
ata0-master: type=cdrom, path=$run/boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$run/serial.txt
display_library: nogui
log: $run/bochs.log
clock: sync=none
EOF
log "booting the emulated Sapphire Rapids"
status=0
timeout "$timeout_s" "$bochs" -q -f "$run/bochsrc" >"$run/bochs.out" 2>&1 || status=$?
serial=$(tr -d '\r' <"$run/serial.txt" 2>/dev/null || true)
# The program's output, without the kernel's lines.
grep -v '^\[ *[0-9]*\.[0-9]*\] ' <<<"$serial" | grep -v '^amx-emulator: exit status' || true
code=$(grep -o 'amx-emulator: exit status [0-9]*' <<<"$serial" | tail -1 | grep -o '[0-9]*$' || true)
if [[ -z "$code" ]]; then
  log "the program did not finish (emulator status $status); the kernel said:"
  grep '^\[ *[0-9]*\.[0-9]*\] ' <<<"$serial" | tail -30 >&2 || true
  tail -5 "$run/bochs.log" >&2 || true
  exit 1
fi
exit "$code"
